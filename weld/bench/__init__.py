"""`weld bench`: offline throughput of the engine, side by side with HF transformers and llama.cpp.

    weld bench                                  # bundled SmolLM2-135M, batch 1,4,16,64, 128 in / 128 out
    weld bench --vs hf --vs llamacpp --runs 3   # the same prompts through the other engines, interleaved
    weld bench --spec ngram --prompts benchmarks/prompts/copy_edit.txt --chat --batch-sizes 1
                                                # weld with and without n-gram speculation, interleaved
    weld bench --chart benchmarks/results/X.json  # redraw X.svg from a result file; runs nothing

Next to the JSON (--out X.json) goes X.svg: decode tok/s against batch size per engine, with
each engine's floor. While it runs, stderr shows the step running (engine, batch size, warm-up
or timed run i of n), the elapsed time and the last run's tok/s: a bar on a terminal; one line
per finished step elsewhere with WELD_PROGRESS=1 (e.g. in CI); nothing with WELD_PROGRESS=0.

What is measured (every engine gets the same random prompt token ids, greedy, exactly
`--output-len` new tokens whatever it samples; with `--prompts FILE`, the file's texts, one per
line, stopping at EOS unless `--ignore-eos`, so that the model does the task it was asked):

- decode tok/s at batch B: B * (out - 1) / (t(out tokens) - t(1 token)). The 1-token run is
  prefill + first token, so the difference is the decode of the other out - 1 tokens per row.
  With --prompts the prompts run in groups of B and the tokens are those actually produced:
  (tokens of the full runs - tokens of the 1-token runs) / (sum of t_full - sum of t_one).
- prefill tok/s: a `--prefill-len` prompt with max_tokens=1, prompt tokens / time.
- TTFT: the 1-token run at batch 1 and `--input-len`.
- fraction of the floor: decode is memory-bound, so a step cannot beat the bytes it must read
  (see `floor_bytes`) over the memory bandwidth, which is measured in the same run. A speculative
  engine can pass 100%: one verification step reads the weights once for up to k + 1 tokens
  (its floor counts the target's weights only, not a draft model's).
- with --spec: a second weld engine with speculative decoding runs every workload right after
  (or, every other repetition, right before) the plain one; the report adds its speedup and its
  acceptance (mean acceptance length, per-position rates) counted over the timed full runs only.

Medians of `--runs` repetitions; the engines' repetitions are interleaved so that a change in
background load hits them all alike. Raw times go to the JSON file. Nothing here is imported by
the engine: this package sits above it, like the CLI.
"""

# The package: flags.py (the flags, BenchConfig), engines.py (weld, HF, llama.cpp), roofline.py
# (bandwidth and the floor), runner.py (the interleaved run), progress.py (what runs, on stderr),
# summary.py (raw times -> figures), report.py (the table), chart.py (the SVG). This module is what
# weld/cli.py calls: add_arguments and main.

from __future__ import annotations

import argparse
import datetime
import json
import pathlib

from weld.bench.flags import add_arguments, config_from_args
from weld.utils.errors import InvalidInputError


__all__ = ["add_arguments", "main"]


def main(args: argparse.Namespace) -> int:
    """`weld bench`: validates the flags, runs, prints the table, writes the JSON and its chart
    (X.json -> X.svg). `--chart FILE...` only redraws the charts of existing result files."""
    from weld.bench.chart import chart_files, write_chart

    if args.chart:
        return chart_files(args.chart)
    from weld.bench.report import default_out_path, format_table
    from weld.bench.runner import run

    cfg = config_from_args(args)
    out = pathlib.Path(cfg.out) if cfg.out else default_out_path(datetime.datetime.now())
    if out.exists() and out.is_dir():
        raise InvalidInputError(f"--out {out} is a directory; give a file path")
    result = run(cfg)
    print(format_table(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    try:
        print(f"wrote {out} and its chart {write_chart(result, out)}")
    except InvalidInputError as err:  # e.g. no run gave a decode rate: the JSON still stands
        print(f"wrote {out} (no chart: {err})")
    return 0
