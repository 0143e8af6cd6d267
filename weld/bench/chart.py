"""The chart of a `weld bench` result: decode tok/s against batch size, one line per engine (weld,
weld with speculation, HF transformers, llama.cpp: whatever the result holds), and each engine's
floor (the bandwidth roofline of `roofline.floor_bytes`) dashed. An SVG written by hand, no
plotting library: both axes are logarithmic (the batch sizes double, the floor grows ~B).

    weld bench --out X.json                 # writes X.svg next to X.json
    weld bench --chart X.json Y.json        # redraws from existing result files, runs nothing
    python -m weld.bench.chart X.json       # the same

Every value comes from the JSON. The SVG keeps them as data attributes (`data-batch`,
`data-tok-s` on each point; the axes' ends on the plot group), so a reader or a test can check
the drawing against the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import xml.etree.ElementTree as ET
from typing import Any, Sequence

from weld.utils.errors import InvalidInputError, WeldError

SVG_NS = "http://www.w3.org/2000/svg"
COLORS = {"weld": "#1565c0", "weld-spec": "#2e7d32", "hf": "#ef6c00", "llamacpp": "#c62828"}
OTHER_COLORS = ("#6a1b9a", "#00838f", "#5d4037", "#ad1457")
FLOOR_SHARED_COLOR = "#616161"  # a floor several engines share

# Layout in px: the plot area, the legend to its right, the title above.
WIDTH, HEIGHT = 920, 560
LEFT, RIGHT, TOP, BOTTOM = 80, 640, 92, 482
LEGEND_X = RIGHT + 24


@dataclasses.dataclass(frozen=True)
class Series:
    """One engine's decode figures: (batch, tok/s) and (batch, floor tok/s), batches ascending.
    A batch whose runs gave no rate (noise made t_full <= t_one) has no point."""

    name: str  # the engine's key in the result ("weld", "weld-spec", "hf", "llamacpp")
    label: str  # what the engine calls itself ("weld float32 q4_1 q8_0")
    points: tuple[tuple[int, float], ...]
    floor: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class LogAxis:
    """Data values lo..hi on a log scale, drawn from pixel `start` to pixel `end`."""

    lo: float
    hi: float
    start: float
    end: float

    def px(self, value: float) -> float:
        share = (math.log(value) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))
        return self.start + share * (self.end - self.start)


def series_of(result: Any, where: str = "the result") -> list[Series]:
    """The engines' series of a `weld bench` result dict; a clear InvalidInputError for anything
    else (another benchmark's JSON, a truncated file)."""
    if not isinstance(result, dict) or not isinstance(result.get("engines"), dict):
        keys = ", ".join(list(result)[:8]) if isinstance(result, dict) else f"a JSON {type(result).__name__}"
        raise InvalidInputError(f"{where} is not a `weld bench` result: it has no \"engines\" (it holds {keys}); "
                                "only files that `weld bench --out` wrote can be charted")
    series = []
    for name, engine in result["engines"].items():
        decode = engine.get("decode") if isinstance(engine, dict) else None
        if not isinstance(decode, dict):
            raise InvalidInputError(f"{where}: engine {name!r} has no \"decode\" figures per batch size")
        try:
            rows = sorted((int(batch), row) for batch, row in decode.items())
            points = tuple((b, float(row["tok_s"])) for b, row in rows if row.get("tok_s"))
            floor = tuple((b, float(row["floor_tok_s"])) for b, row in rows if row.get("floor_tok_s"))
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise InvalidInputError(f"{where}: engine {name!r} has malformed decode figures ({err!r})") from None
        series.append(Series(name, str(engine.get("label") or name), points, floor))
    if not any(s.points for s in series):
        raise InvalidInputError(f"{where} holds no decode tok/s to chart (no engine has a valid run)")
    return series


def floor_groups(series: list[Series]) -> list[tuple[list[Series], tuple[tuple[int, float], ...]]]:
    """Engines whose floors are equal (within 0.5% at every batch) share one floor line: weld and
    weld-spec always do (the floor counts the target's weights), weld and llama.cpp do when they
    read the same quantized formats."""
    groups: list[tuple[list[Series], tuple[tuple[int, float], ...]]] = []
    for s in series:
        if not s.floor:
            continue
        for members, floor in groups:
            if [b for b, _ in floor] == [b for b, _ in s.floor] and all(
                    abs(x - y) <= 0.005 * max(x, y) for (_, x), (_, y) in zip(floor, s.floor)):
                members.append(s)
                break
        else:
            groups.append(([s], s.floor))
    return groups


def log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks between lo and hi (only powers of ten over more than three decades; every
    integer mantissa if the range is too narrow for two ticks)."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mantissas in ((1,) if math.log10(hi / lo) > 3 else (1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0 ** k for k in range(first, last + 1) for m in mantissas if lo <= m * 10.0 ** k <= hi]
        if len(ticks) >= 2:
            return ticks
    return ticks


def fmt_number(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:g}k"
    return f"{value:g}" if value >= 1 else f"{value:.2g}"


def title_lines(result: dict) -> list[str]:
    """Model and its weights, date and machine (CPU and the flags the kernels choose by), workload."""
    cfg, machine = result.get("config", {}), result.get("machine", {})
    engines = result["engines"]
    weld = engines.get("weld", {})
    source = cfg.get("model_source")
    model = cfg.get("model_name") or cfg.get("model") or "the bundled model"
    if source and pathlib.PurePath(source).suffix == ".gguf":  # the file name says the quantization
        model = pathlib.PurePath(source).name
    weights = [f"weld {weld.get('dtype', '?')}" + "".join(f" {f}" for f in weld.get("quantized_formats") or ())]
    if cfg.get("quantization"):
        weights.append(f"--quantization {cfg['quantization']}")
    if weld.get("kv_dtype"):
        weights.append(f"KV {weld['kv_dtype']}")
    first = f"weld bench: {model} · " + ", ".join(weights)

    date = str(result.get("started", "date unknown")).replace("T", " ")
    flags = machine.get("cpu_flags")
    if flags is None:
        flag_text = "CPU flags not recorded"
    else:
        flag_text = "flags " + (" ".join(flags) if flags else "(none the kernels use)")
    cpu = f"{machine.get('cpu') or 'CPU unknown'}, {machine.get('cpu_count', '?')} cores, {flag_text}"
    second = f"{date} · {cpu}"

    work = result.get("workload", {})
    if cfg.get("prompts"):
        what = f"{work.get('num_prompts', '?')} prompts of {cfg['prompts']}, up to {cfg.get('output_len')} new tokens"
    else:
        what = f"prompt {cfg.get('input_len')} tokens, {cfg.get('output_len')} new"
    third = f"{what}; median of {cfg.get('runs', '?')} runs"
    spec = (result.get("speculative") or {}).get("config")
    if spec:
        k = spec.get("num_speculative_tokens")
        third += f"; speculative: {spec.get('method')}" + (f" k={k}" if k else "") + " vs plain"
    return [first, second, third]


def render_svg(result: dict, source: str | None = None) -> str:
    """The chart of a result dict, as SVG text."""
    series = series_of(result, source or "the result")
    floors = floor_groups(series)
    batches = sorted({b for s in series for b, _ in s.points + s.floor})
    values = [v for s in series for _, v in s.points + s.floor]
    # Pad the ends by a third of a doubling (a factor 1.3 in tok/s), and widen one batch size.
    x = LogAxis(batches[0] / 2 ** 0.35, batches[-1] * 2 ** 0.35, LEFT, RIGHT)
    if len(batches) == 1:
        x = LogAxis(batches[0] / 2, batches[0] * 2, LEFT, RIGHT)
    y = LogAxis(min(values) / 1.3, max(values) * 1.3, BOTTOM, TOP)

    svg = ET.Element("svg", {"xmlns": SVG_NS, "width": str(WIDTH), "height": str(HEIGHT),
                             "viewBox": f"0 0 {WIDTH} {HEIGHT}", "font-family": "sans-serif", "font-size": "12"})
    ET.SubElement(svg, "title").text = title_lines(result)[0]
    ET.SubElement(svg, "desc").text = (f"{result.get('command', '')}\nsource: {source or '?'}\n"
                                       "Values: data-batch / data-tok-s on each point; the plot group's "
                                       "data-x-min..data-x-max and data-y-min..data-y-max are the axes' ends "
                                       "(log scale) at its data-left..data-right and data-bottom..data-top.")
    ET.SubElement(svg, "rect", {"width": "100%", "height": "100%", "fill": "white"})
    for i, line in enumerate(title_lines(result)):
        text = ET.SubElement(svg, "text", {"x": str(LEFT), "y": str(24 + 18 * i),
                                           "font-size": "15" if i == 0 else "12", "fill": "#222" if i == 0 else "#555"})
        if i == 0:
            text.set("font-weight", "bold")
        text.text = line

    plot = ET.SubElement(svg, "g", {"class": "plot", "data-scale": "log", "data-x-min": repr(x.lo),
                                    "data-x-max": repr(x.hi), "data-y-min": repr(y.lo), "data-y-max": repr(y.hi),
                                    "data-left": str(LEFT), "data-right": str(RIGHT), "data-top": str(TOP),
                                    "data-bottom": str(BOTTOM)})
    axes = ET.SubElement(plot, "g", {"class": "axes", "stroke": "#ccc", "stroke-width": "1"})
    labels = ET.SubElement(plot, "g", {"class": "ticks", "fill": "#333", "font-size": "11"})
    for b in batches:
        px = f"{x.px(b):.2f}"
        ET.SubElement(axes, "line", {"x1": px, "x2": px, "y1": str(TOP), "y2": str(BOTTOM + 5)})
        ET.SubElement(labels, "text", {"x": px, "y": str(BOTTOM + 19), "text-anchor": "middle"}).text = str(b)
    for tick in log_ticks(y.lo, y.hi):
        py = f"{y.px(tick):.2f}"
        ET.SubElement(axes, "line", {"x1": str(LEFT - 5), "x2": str(RIGHT), "y1": py, "y2": py})
        ET.SubElement(labels, "text", {"x": str(LEFT - 8), "y": py, "text-anchor": "end",
                                       "dominant-baseline": "middle"}).text = fmt_number(tick)
    ET.SubElement(plot, "rect", {"x": str(LEFT), "y": str(TOP), "width": str(RIGHT - LEFT),
                                 "height": str(BOTTOM - TOP), "fill": "none", "stroke": "#444"})
    ET.SubElement(plot, "text", {"x": str((LEFT + RIGHT) / 2), "y": str(BOTTOM + 40), "text-anchor": "middle",
                                 "font-size": "13"}).text = "batch size (log scale)"
    ET.SubElement(plot, "text", {"x": "0", "y": "0", "text-anchor": "middle", "font-size": "13",
                                 "transform": f"translate({LEFT - 56},{(TOP + BOTTOM) / 2}) rotate(-90)"}
                  ).text = "decode tok/s, all rows of the batch (log scale)"

    color = {s.name: COLORS.get(s.name) or OTHER_COLORS[i % len(OTHER_COLORS)] for i, s in enumerate(series)}
    floor_color = [color[m[0].name] if len(m) == 1 else FLOOR_SHARED_COLOR for m, _ in floors]
    for (members, floor), stroke in zip(floors, floor_color):
        group = ET.SubElement(plot, "g", {"class": "floor", "data-engines": ",".join(s.name for s in members)})
        ET.SubElement(group, "title").text = "floor of " + ", ".join(s.label for s in members) + ": " + ", ".join(
            f"batch {b}: {v:.1f} tok/s" for b, v in floor)
        ET.SubElement(group, "polyline", {
            "points": " ".join(f"{x.px(b):.2f},{y.px(v):.2f}" for b, v in floor), "fill": "none",
            "stroke": stroke, "stroke-width": "1.5", "stroke-dasharray": "7 4",
            "data-floor-tok-s": " ".join(repr(v) for _, v in floor)})

    speculative = (result.get("speculative") or {}).get("per_batch") or {}
    engines = result["engines"]
    for s in series:
        group = ET.SubElement(plot, "g", {"class": "series", "data-engine": s.name, "data-label": s.label})
        ET.SubElement(group, "polyline", {"points": " ".join(f"{x.px(b):.2f},{y.px(v):.2f}" for b, v in s.points),
                                          "fill": "none", "stroke": color[s.name], "stroke-width": "2.5"})
        for b, v in s.points:
            point = ET.SubElement(group, "circle", {"cx": f"{x.px(b):.2f}", "cy": f"{y.px(v):.2f}", "r": "4.5",
                                                    "fill": color[s.name], "data-batch": str(b), "data-tok-s": repr(v)})
            tip = f"{s.label}, batch {b}: {v:.1f} tok/s"
            fraction = engines[s.name]["decode"][str(b)].get("floor_fraction")
            if fraction:
                tip += f", {100 * fraction:.0f}% of the floor"
            speedup = speculative.get(str(b), {}).get("speedup")
            if s.name == "weld-spec" and speedup:
                tip += f", {speedup:.2f}x plain weld"
            ET.SubElement(point, "title").text = tip

    legend = ET.SubElement(svg, "g", {"class": "legend"})
    row = TOP + 8

    def entry(label: str, stroke: str, dashed: bool = False, dot: bool = False) -> None:
        nonlocal row
        line = {"x1": str(LEGEND_X), "x2": str(LEGEND_X + 28), "y1": str(row), "y2": str(row), "stroke": stroke,
                "stroke-width": "1.5" if dashed else "2.5"}
        if dashed:
            line["stroke-dasharray"] = "7 4"
        ET.SubElement(legend, "line", line)
        if dot:
            ET.SubElement(legend, "circle", {"cx": str(LEGEND_X + 14), "cy": str(row), "r": "4.5", "fill": stroke})
        ET.SubElement(legend, "text", {"x": str(LEGEND_X + 36), "y": str(row), "dominant-baseline": "middle"}
                      ).text = label
        row += 20

    for s in series:
        plain = " (plain)" if s.name == "weld" and "weld-spec" in engines else ""
        entry(s.label + plain + ("" if s.points else " (no valid run)"), color[s.name], dot=True)
    row += 8
    for (members, _), stroke in zip(floors, floor_color):
        if len(members) == 1:
            entry(f"floor, {members[0].label}", stroke, dashed=True)
            continue
        entry("floor, shared by", stroke, dashed=True)
        row -= 4
        for s in members:
            ET.SubElement(legend, "text", {"x": str(LEGEND_X + 44), "y": str(row), "dominant-baseline": "middle",
                                           "font-size": "11", "fill": "#444"}).text = s.label
            row += 16
        row += 4

    bandwidth = (result.get("bandwidth_start") or {}).get("used_gb_s")
    note = ("floor: B x memory bandwidth" + (f" ({bandwidth:.1f} GB/s, measured in the run)" if bandwidth else "")
            + " / bytes a decode step reads (all weights in the engine's format + the mean KV in context)")
    ET.SubElement(svg, "text", {"x": str(LEFT), "y": str(HEIGHT - 16), "font-size": "11", "fill": "#555"}).text = note
    ET.indent(svg, space=" ")
    return ET.tostring(svg, encoding="unicode") + "\n"


def chart_path(json_path: pathlib.Path) -> pathlib.Path:
    """X.json -> X.svg (a name without .json gets .svg appended)."""
    if json_path.suffix == ".json":
        return json_path.with_suffix(".svg")
    return json_path.with_name(json_path.name + ".svg")


def write_chart(result: dict, json_path: pathlib.Path) -> pathlib.Path:
    """Writes the chart of `result` next to its JSON file; returns its path."""
    out = chart_path(json_path)
    out.write_text(render_svg(result, str(json_path)), encoding="utf-8")
    return out


def chart_file(json_path: str | pathlib.Path) -> pathlib.Path:
    """Reads an existing result file and writes its chart next to it."""
    path = pathlib.Path(json_path)
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidInputError(f"--chart {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidInputError(f"--chart {path}: cannot read it ({err})") from None
    except json.JSONDecodeError as err:
        raise InvalidInputError(f"--chart {path}: not valid JSON ({err})") from None
    series_of(result, str(path))
    return write_chart(result, path)


def chart_files(paths: Sequence[str]) -> int:
    """Charts each file; reports every file that cannot be charted, then fails if any could not."""
    failed = []
    for p in paths:
        try:
            print(f"wrote {chart_file(p)}")
        except WeldError as err:
            failed.append(str(err))
    if len(failed) == 1 and len(paths) == 1:
        raise InvalidInputError(failed[0])
    for message in failed:
        print(f"weld: error: {message}", file=sys.stderr)
    if failed:
        raise InvalidInputError(f"{len(failed)} of {len(paths)} files could not be charted (see above)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weld.bench.chart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", metavar="RESULT.json", help="`weld bench` result files")
    args = parser.parse_args(argv)
    try:
        return chart_files(args.results)
    except WeldError as err:
        print(f"weld: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
