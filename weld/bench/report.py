"""The `weld bench` report: the result dict as a plain-text table (`format_table`, with the
speculative section of `format_speculative`), and where the JSON goes by default."""

from __future__ import annotations

import datetime
import pathlib

from weld.bench.engines import SPEC_ENGINE


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(result: dict) -> str:
    """The result as a plain-text table: one column per engine, then weld/other ratios."""
    engines = result["engines"]
    names = list(engines)
    others = [n for n in names if n not in ("weld", SPEC_ENGINE)]
    cfg = result["config"]
    bw = result["bandwidth_start"]
    work = result["workload"]
    if cfg["prompts"]:
        what = (f"{work['num_prompts']} prompts of {cfg['prompts']} ({'chat template, ' if cfg['chat'] else ''}"
                f"mean {work['input_len']} tokens), up to {cfg['output_len']} new"
                + (" (stopping at EOS)" if work["stop_at_eos"] else ""))
    else:
        what = f"prompt {cfg['input_len']} tokens, {cfg['output_len']} new"
    lines = [
        f"weld bench: {cfg['model_name']}, {what}, greedy; "
        f"median of {cfg['runs']} run{'s' if cfg['runs'] > 1 else ''}" + (f" ({cfg['vs_runs']} for {', '.join(others)})"
                                            if others and cfg['vs_runs'] != cfg['runs'] else ""),
        f"memory bandwidth {bw['used_gb_s']:.1f} GB/s (numpy on {bw['array_gb']:.1f} GB: copy {bw['copy_gb_s']:.1f} "
        f"r+w, sum {bw['sum_gb_s']:.1f}); at the end {result['bandwidth_end']['used_gb_s']:.1f} GB/s",
    ]
    label_width = max(18, *(len(engines[n]["label"]) for n in names))
    for n in names:
        e = engines[n]
        extra = f", {e['torch_threads']} torch threads" if "torch_threads" in e else (
            f", {e['threads']} threads" if "threads" in e else "")
        lines.append(f"  {e['label']:<{label_width}} {e['batching']}{extra}; KV {e['kv_dtype']}; "
                     f"{e['weight_bytes']['total'] / 1e6:.3g} MB of weights")
    width = max(14, *(len(engines[n]["label"]) + 2 for n in names))
    head = f"{'':24}" + "".join(f"{engines[n]['label']:>{width}}" for n in names) + "".join(
        f"{'weld/' + engines[n]['label'].split()[0]:>{width}}" for n in others)
    lines += ["", head, "-" * len(head)]
    ratio = result["ratios"]
    for b in map(str, cfg["batch_sizes"]):
        row = f"{'decode tok/s, batch ' + b:24}" + "".join(
            f"{_fmt(engines[n]['decode'].get(b, {}).get('tok_s'), '.1f'):>{width}}" for n in names)
        row += "".join(f"{_fmt(ratio[f'weld/{n}']['decode'].get(b), '.2f', 'x'):>{width}}" for n in others)
        lines.append(row)
    for b in map(str, cfg["batch_sizes"]):
        fractions = [engines[n]["decode"].get(b, {}).get("floor_fraction") for n in names]
        lines.append(f"{'% of floor, batch ' + b:24}" + "".join(
            f"{_fmt(f and 100 * f, '.0f', '%'):>{width}}" for f in fractions))
    lines.append(f"{'prefill tok/s, ' + str(cfg['prefill_len']):24}" + "".join(
        f"{_fmt(engines[n]['prefill']['tok_s'], '.0f'):>{width}}" for n in names) + "".join(
        f"{_fmt(ratio[f'weld/{n}']['prefill'], '.2f', 'x'):>{width}}" for n in others))
    lines.append(f"{'TTFT ms, batch 1':24}" + "".join(
        f"{_fmt(engines[n]['ttft_s'] and 1e3 * engines[n]['ttft_s'], '.1f'):>{width}}" for n in names) + "".join(
        f"{_fmt(ratio[f'weld/{n}']['ttft'], '.2f', 'x'):>{width}}" for n in others))
    lines.append(f"{'load s':24}" + "".join(f"{engines[n]['load_s']:>{width}.1f}" for n in names))
    if "speculative" in result:
        lines += ["", *format_speculative(result["speculative"])]
    compiled = {engines[n]["label"]: engines[n]["compiles_during_timed_runs"] for n in names
                if engines[n].get("compiles_during_timed_runs")}
    if compiled:
        lines.append(f"warning: programs compiled during the timed runs ({compiled}): those runs include compile time")
    lines.append("")
    lines.append("decode tok/s: aggregate over the batch, B * (out - 1) / (t(out tokens) - t(1 token)) "
                 "(text prompts: the new tokens actually produced after the first, over the same time); "
                 "% of floor: of B * bandwidth / bytes read per step (all weights in the engine's format + the "
                 "mean KV in context); ratios above 1: weld is faster (TTFT: other's time / weld's).")
    load = result["machine"]
    lines.append(f"load average (1 min) {load['loadavg_start'][0]:.2f} at start, {load['loadavg_end'][0]:.2f} at end, "
                 f"on {load['cpu_count']} cores: above ~0.5, other work shared the machine.")
    return "\n".join(lines)


def format_speculative(spec: dict) -> list[str]:
    """The speculative section: speedup over plain decoding and acceptance, per batch size."""
    config = spec["config"]
    method = config["method"] + (f" {config['prompt_lookup_min']}..{config['prompt_lookup_max']}-grams"
                                 if config["method"] == "ngram" else f" {config.get('model') or '(the shipped drafter)'}")
    k = config.get("num_speculative_tokens") or "the drafter's block"
    widths = "adaptive widths" if config.get("adaptive", True) else "k drafts every round"
    lines = [f"speculative decoding: {method}, k={k}, {widths}, vs the same engine without it",
             f"{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'mean accepted len':>19}"
             f"{'accepted':>10}   per position (accepted / drafted in slot j)"]
    for b, row in spec["per_batch"].items():
        acc = row["acceptance"] or {}
        positions = " ".join(_fmt(r and 100 * r, ".0f", "%") for r in acc.get("per_position_rate", []))
        rate = acc.get("acceptance_rate")
        lines.append(f"{b:>6}{_fmt(row['plain_tok_s'], '.1f'):>13}{_fmt(row['spec_tok_s'], '.1f'):>12}"
                     f"{_fmt(row['speedup'], '.2f', 'x'):>9}{_fmt(acc.get('mean_acceptance_length'), '.2f'):>19}"
                     f"{_fmt(rate and 100 * rate, '.0f', '%'):>10}   {positions or '-'}")
    differ = [b for b, row in spec["per_batch"].items() if not row["outputs_equal"]]
    if differ:
        lines.append(f"note: greedy outputs differ from plain decoding at batch {', '.join(differ)} "
                     "(float rounding in the batched verification can flip a near tie)")
    lines.append("mean accepted len: tokens per verification step, 1 + accepted / steps that sent drafts; "
                 "accepted: of the drafted tokens.")
    return lines


def default_out_path(now: datetime.datetime) -> pathlib.Path:
    return pathlib.Path("benchmarks") / "results" / f"bench_{now:%Y-%m-%d_%H%M%S}.json"
