"""`weld bench`'s chart and progress, without running a bench: the SVG holds one series per engine
whose points, mapped back through its axes, are the JSON's tok/s; committed result files of every
format redraw, and other JSON files get one clear line; the progress steps print as asked. (The
chart and the progress lines of a real run: test_bench.py.)"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import xml.etree.ElementTree as ET

import pytest

from weld import bench
from weld.bench import chart
from weld.bench.progress import BenchProgress
from weld.utils.errors import InvalidInputError

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
NS = {"svg": chart.SVG_NS}


def unlog(px: float, lo: float, hi: float, start: float, end: float) -> float:
    """A pixel position back to its data value on a log axis."""
    return math.exp(math.log(lo) + (px - start) / (end - start) * (math.log(hi) - math.log(lo)))


def check_chart(svg_path: pathlib.Path, result: dict) -> ET.Element:
    """The chart is valid SVG with one series per engine of `result`, in its order; each point's
    data attributes are the JSON's batch and tok/s, and its position (and the polyline's), mapped
    back through the axes, gives them again; each engine's floor is drawn at its floor_tok_s."""
    root = ET.parse(svg_path).getroot()
    assert root.tag == f"{{{chart.SVG_NS}}}svg"
    plot = root.find("svg:g[@class='plot']", NS)
    left, right, top, bottom = (float(plot.get(f"data-{k}")) for k in ("left", "right", "top", "bottom"))
    x_lo, x_hi, y_lo, y_hi = (float(plot.get(f"data-{k}")) for k in ("x-min", "x-max", "y-min", "y-max"))

    def data_of(x: float, y: float) -> tuple[float, float]:
        return unlog(x, x_lo, x_hi, left, right), unlog(y, y_lo, y_hi, bottom, top)

    series = plot.findall("svg:g[@class='series']", NS)
    assert [g.get("data-engine") for g in series] == list(result["engines"])
    for g in series:
        engine = result["engines"][g.get("data-engine")]
        assert g.get("data-label") == engine["label"]
        expected = sorted((int(b), d["tok_s"]) for b, d in engine["decode"].items() if d["tok_s"])
        points = g.findall("svg:circle", NS)
        assert [(int(p.get("data-batch")), float(p.get("data-tok-s"))) for p in points] == expected
        drawn = [data_of(float(p.get("cx")), float(p.get("cy"))) for p in points]
        line = [data_of(*map(float, xy.split(","))) for xy in g.find("svg:polyline", NS).get("points").split()]
        for positions in (drawn, line):
            assert [b for b, _ in positions] == pytest.approx([b for b, _ in expected], rel=1e-3)
            assert [v for _, v in positions] == pytest.approx([v for _, v in expected], rel=1e-3)
    floors = plot.findall("svg:g[@class='floor']", NS)
    drawn_for = {name: g for g in floors for name in g.get("data-engines").split(",")}
    assert set(drawn_for) == set(result["engines"])
    for name, engine in result["engines"].items():
        expected = sorted((int(b), d["floor_tok_s"]) for b, d in engine["decode"].items())
        line = [data_of(*map(float, xy.split(","))) for xy in
                drawn_for[name].find("svg:polyline", NS).get("points").split()]
        assert [v for _, v in line] == pytest.approx([v for _, v in expected], rel=5e-3)  # shared within 0.5%
    title = " ".join(t.text for t in root.findall("svg:text", NS)[:3])
    assert result["started"].replace("T", " ") in title and result["machine"]["cpu"] in title
    flags = result["machine"].get("cpu_flags")
    if flags is None:
        assert "CPU flags not recorded" in title
    else:
        assert ("flags " + " ".join(flags) if flags else "flags (none") in title
    return root


# One file per format the bench has written: three engines without CPU flags (the first), the
# quantized formats and a KV dtype, text prompts with speculation.
FORMATS = ["bench_2026-11-30_101017.json", "quant_2026-12-01_smollm2_late_kvf16.json",
           "spec_ngram_copy_2026-12-02.json"]


@pytest.mark.parametrize("name", FORMATS)
def test_committed_results_redraw(name, tmp_path, capsys):
    path = tmp_path / name
    shutil.copy(RESULTS / name, path)
    assert chart.main([str(path)]) == 0
    svg = path.with_suffix(".svg")
    assert f"wrote {svg}" in capsys.readouterr().out
    result = json.loads(path.read_text())
    root = check_chart(svg, result)
    legend = " ".join(t.text for t in root.findall("svg:g[@class='legend']/svg:text", NS))
    if "speculative" in result:
        assert "(plain)" in legend and result["engines"]["weld-spec"]["label"] in legend


def test_weld_bench_chart_flag_redraws_several_files(tmp_path, capsys):
    paths = [tmp_path / name for name in FORMATS[:2]]
    for p in paths:
        shutil.copy(RESULTS / p.name, p)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.main(parser.parse_args(["--chart", *map(str, paths)])) == 0
    assert all(p.with_suffix(".svg").exists() for p in paths)


def test_other_json_files_say_what_they_are(tmp_path, capsys):
    perplexity = tmp_path / "perplexity.json"
    shutil.copy(RESULTS / "perplexity_2026-12-01_smollm2.json", perplexity)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{\"engines\": ")
    with pytest.raises(InvalidInputError, match=r"is not a `weld bench` result: it has no \"engines\" \(it holds date"):
        chart.chart_file(perplexity)
    with pytest.raises(InvalidInputError, match="it holds a JSON list"):
        chart.chart_file(tmp_path / "list.json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        chart.chart_file(tmp_path / "broken.json")
    with pytest.raises(InvalidInputError, match="no such file"):
        chart.chart_file(tmp_path / "missing.json")
    assert not list(tmp_path.glob("*.svg"))
    # Several files: each failure on its own line, then the count; the good ones are still drawn.
    good = tmp_path / "good.json"
    shutil.copy(RESULTS / FORMATS[0], good)
    assert chart.main([str(perplexity), str(good)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "perplexity.json is not a `weld bench` result" in err[0] and "1 of 2 files" in err[1]
    assert good.with_suffix(".svg").exists()


def fake_result(decode: dict[str, dict[str, dict]]) -> dict:
    return {"started": "2026-12-03T10:00:00", "machine": {"cpu": "Test CPU", "cpu_count": 2, "cpu_flags": []},
            "config": {"model_name": "tiny", "input_len": 8, "output_len": 4, "runs": 1},
            "bandwidth_start": {"used_gb_s": 10.0},
            "engines": {name: {"label": name.upper(), "decode": d} for name, d in decode.items()}}


def test_a_batch_without_a_valid_run_has_no_point_and_one_batch_size_draws(tmp_path):
    result = fake_result({"weld": {"1": {"tok_s": 10.0, "floor_tok_s": 50.0},
                                   "4": {"tok_s": None, "floor_tok_s": 200.0},
                                   "16": {"tok_s": 90.0, "floor_tok_s": 800.0}},
                          "hf": {"1": {"tok_s": 5.0, "floor_tok_s": 30.0}}})
    path = tmp_path / "r.json"
    root = check_chart(chart.write_chart(result, path), result)
    series = root.findall(".//svg:g[@class='series']", NS)
    assert [len(g.findall("svg:circle", NS)) for g in series] == [2, 1]
    one = fake_result({"weld": {"4": {"tok_s": 10.0, "floor_tok_s": 50.0}}})
    check_chart(chart.write_chart(one, tmp_path / "one.json"), one)
    with pytest.raises(InvalidInputError, match="no decode tok/s to chart"):
        chart.render_svg(fake_result({"weld": {"1": {"tok_s": None, "floor_tok_s": 50.0}}}))
    with pytest.raises(InvalidInputError, match="engine 'hf' has no \"decode\""):
        chart.render_svg({"engines": {"hf": {"label": "HF"}}})


def test_engines_with_the_same_floor_share_one_line():
    same = chart.Series("weld", "W", ((1, 1.0),), ((1, 100.0), (4, 400.0)))
    near = chart.Series("weld-spec", "S", ((1, 2.0),), ((1, 100.2), (4, 400.0)))
    other = chart.Series("hf", "H", ((1, 1.0),), ((1, 50.0), (4, 200.0)))
    groups = chart.floor_groups([same, near, other])
    assert [[s.name for s in members] for members, _ in groups] == [["weld", "weld-spec"], ["hf"]]


def test_log_ticks():
    assert chart.log_ticks(3, 1100) == [5, 10, 20, 50, 100, 200, 500, 1000]
    assert chart.log_ticks(0.5, 20_000) == [1, 10, 100, 1000, 10_000]  # over 3 decades: powers of ten
    assert chart.log_ticks(210, 480) == [300, 400]  # too narrow for 1-2-5


# ----- progress -----

def test_progress_lines_when_not_a_terminal(capsys):
    now = iter([0.0, 1.5, 4.25, 6.0])
    with BenchProgress(3, enabled=True, tty=False, clock=lambda: next(now)) as p:
        assert p.mode == "lines"
        p.begin("warm-up + compile | weld f32 | batch 1")
        p.finish("warm-up + compile | weld f32 | batch 1", 1.5)
        p.finish("timed run 1/2 | weld f32 | batch 4", 0.5, decode=("weld f32", 4, 120.0))
        p.finish("timed run 2/2 | weld f32 | batch 4", 0.25, decode=("weld f32", 4, 100.0))
    assert capsys.readouterr().err.splitlines() == [
        "[    1.5s   1/3] warm-up + compile | weld f32 | batch 1: 1.50s",
        "[    4.2s   2/3] timed run 1/2 | weld f32 | batch 4: 0.50s, decode 120.0 tok/s",
        "[    6.0s   3/3] timed run 2/2 | weld f32 | batch 4: 0.25s, decode 100.0 tok/s (median 110.0)"]


def test_progress_bar_on_a_terminal_and_nothing_when_off(capsys):
    with BenchProgress(2, enabled=True, tty=True) as p:
        assert p.mode == "bar"
        p.begin("timed run 1/1 | weld f32 | batch 16")
        p.finish("timed run 1/1 | weld f32 | batch 16", 0.5, decode=("weld f32", 16, 321.0))
    err = capsys.readouterr().err
    assert "timed run 1/1 | weld f32 | batch 16" in err and "tok_s=321.0" in err and "/2 [" in err
    with BenchProgress(2, enabled=False, tty=True) as p:
        p.begin("x")
        p.finish("x", 1.0, decode=("weld", 1, 1.0))
    assert p.mode is None and capsys.readouterr().err == ""
