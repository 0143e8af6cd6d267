"""What a speculative verification costs against a plain decode step, on the real engine.

    python benchmarks/verify_cost.py [--model M] [--ks 1,3,5,7] [--batch-sizes 1,4] [--context 256]
                                     [--runs 15] [--out FILE.json]

For each batch size b: one plain decode call of one step (the runner's fused decode program
with steps_per_call 1: forward over [b, 1], sampling, stop checks), and for each k one
verification call of one round (forward over [b, k + 1] with the n-gram drafter's lookup,
acceptance) on sequences of `--context` tokens. Both are `ModelRunner.execute` on the same kind
of plan, so host batching and the copy back are in both. The pages hold whatever they hold (the
cost does not depend on the values). Calls alternate between the programs so that the machine's
drift falls on all of them alike; the table gives medians and the ratio to the plain step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


def plan_for(kind: str, b: int, context: int, page_size: int, max_steps: int, spec_width: int = 0):
    """A decode or verify plan of b dummy sequences of `context` tokens (a repeated phrase, so
    n-gram lookup always finds drafts), each on pages of its own; a verify plan lets each row
    send spec_width drafts a round."""
    from weld.engine.sampling_params import SamplingParams
    from weld.engine.scheduler import ScheduledSeq, SchedulerOutput
    from weld.engine.sequence import Sequence

    params = SamplingParams(max_tokens=max_steps, temperature=0, ignore_eos=True)
    pages = -(-(context + max_steps) // page_size)
    entries = []
    for i in range(b):
        seq = Sequence(f"bench{i}", ([11, 12, 13, 14, 15, 16, 17] * context)[:context], params)
        seq.block_tables = [list(range(i * pages, (i + 1) * pages))]
        entries.append(ScheduledSeq(seq, context - 1, 1, sample=True, max_steps=max_steps))
    return SchedulerOutput(kind, entries, spec_width=spec_width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ks", default="1,3,5,7")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from weld import LLM
    from weld.bench.roofline import machine_info, measure_bandwidth
    import os

    try:
        ks = [int(x) for x in args.ks.split(",")]
        batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--ks and --batch-sizes take integers, comma separated, got {args.ks!r} and {args.batch_sizes!r}")
    if not all(1 <= k <= 16 for k in ks) or not all(1 <= b <= 256 for b in batch_sizes):
        parser.error(f"--ks must be in [1, 16] and --batch-sizes in [1, 256], got {args.ks} and {args.batch_sizes}")
    if not 8 <= args.context <= 1 << 16 or not 1 <= args.runs <= 1000:
        parser.error(f"--context must be in [8, 65536] and --runs in [1, 1000], got {args.context} and {args.runs}")
    load = os.getloadavg()
    common = dict(max_model_len=args.context + 128, max_num_seqs=max(batch_sizes), progress=False)
    engines = {"decode": LLM(args.model, steps_per_call=1, **common)}
    for k in ks:
        engines[f"verify k={k}"] = LLM(args.model, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "rounds_per_call": 1}, **common)
    page_size = engines["decode"].engine.block_manager.page_size
    results = {}
    for b in batch_sizes:
        calls = {}
        for name, llm in engines.items():
            k = 0 if name == "decode" else int(name.split("=")[1])
            plan = plan_for("decode" if k == 0 else "verify", b, args.context, page_size, k + 1, spec_width=k)
            runner = llm.engine.runner
            num_drafts = np.full(b, k, np.int32) if k else None
            calls[name] = (lambda runner=runner, plan=plan, nd=num_drafts: runner.execute(plan, num_drafts=nd))
            calls[name]()  # compile
            result = calls[name]()
            if k and not np.all(result.num_drafts[:, 0] == k):  # a round that sends fewer measures less
                raise SystemExit(f"verify k={k}: the rows sent {result.num_drafts[:, 0].tolist()} drafts, not {k}")
        times = {name: [] for name in calls}
        for _ in range(args.runs):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        base = float(np.median(times["decode"]))
        results[b] = {name: {"ms": round(1e3 * float(np.median(t)), 2),
                             "ratio": round(float(np.median(t)) / base, 3)} for name, t in times.items()}
    report = {"date": datetime.date.today().isoformat(), "context": args.context, "runs": args.runs,
              "model": args.model or "bundled SmolLM2-135M-Instruct Q4_1", "machine": machine_info(load),
              "bandwidth": measure_bandwidth(), "results": {str(b): r for b, r in results.items()}}
    lines = ["| batch | program | ms (median) | / decode step |", "|---:|---|---:|---:|"]
    for b, r in results.items():
        for name, x in r.items():
            lines.append(f"| {b} | {name} | {x['ms']} | {x['ratio']:.2f}x |")
    print("\n".join(lines))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
