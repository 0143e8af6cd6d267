"""DSpark drafters side by side in one process: a plain engine and one speculative engine per
drafter directory, in alternating passes over chat.txt (greedy, chat template, up to 128 new
tokens) at batch 1 and 4; medians of the passes after the first (which compiles), with each
drafter's acceptance over its timed passes. In one process the host's load hits every engine
alike, which separate `weld bench` runs on a shared 2-core machine do not.

    python benchmarks/spec_drafters_inproc.py [--passes 4] [--output FILE.json] DRAFTER_DIR...

("shipped" names the drafter weld ships for the bundled model.)
"""
import argparse
import json
import pathlib
import statistics
import time

from weld.engine.llm import LLM
from weld.engine.sampling_params import SamplingParams

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("drafters", nargs="+", help="drafter directories ('shipped': the built-in one)")
ap.add_argument("--passes", type=int, default=4, help="timed passes per engine and batch size (default: 4)")
ap.add_argument("--output", default=None, help="write the medians and acceptance here as JSON")
args = ap.parse_args()
if not 1 <= args.passes <= 50:
    ap.error(f"--passes must be in [1, 50], got {args.passes}")
for d in args.drafters:
    if d != "shipped" and not (pathlib.Path(d) / "config.json").is_file():
        ap.error(f"{d}: not a drafter directory (no config.json)")
prompts = [line.strip() for line in open("benchmarks/prompts/chat.txt") if line.strip()]
messages = [[{"role": "user", "content": p}] for p in prompts]
params = SamplingParams(max_tokens=128, temperature=0)
engines = {"plain": LLM(progress=False)}
for d in args.drafters:
    engines[d] = LLM(speculative_config={"method": "dspark", **({} if d == "shipped" else {"model": d})}, progress=False)
speeds: dict = {}
stats: dict = {}
names = list(engines)
for rep in range(args.passes + 1):
    for name in (names if rep % 2 == 0 else names[::-1]):
        llm = engines[name]
        for batch in (1, 4):
            before = dict(llm.engine.stats()) if name != "plain" else {}
            start, tokens = time.perf_counter(), 0
            for i in range(0, len(messages), batch):
                tokens += sum(len(o.outputs[0].token_ids) for o in llm.chat(messages[i:i + batch], params, use_tqdm=False))
            rate = tokens / (time.perf_counter() - start)
            if rep:
                speeds.setdefault((name, batch), []).append(rate)
                if name != "plain":
                    after = llm.engine.stats()
                    acc = stats.setdefault((name, batch), {"drafts": 0, "accepted": 0})
                    acc["drafts"] += after["spec_num_drafts"] - before.get("spec_num_drafts", 0)
                    acc["accepted"] += after["spec_num_accepted_tokens"] - before.get("spec_num_accepted_tokens", 0)
            print(f"pass {rep} {name} b{batch}: {tokens} tokens, {rate:.1f} tok/s", flush=True)
out = {}
for batch in (1, 4):
    plain = statistics.median(speeds[("plain", batch)])
    for name in names:
        median = statistics.median(speeds[(name, batch)])
        row = {"median_tok_s": round(median, 1), "vs_plain": round(median / plain, 3),
               "passes": [round(x, 1) for x in speeds[(name, batch)]]}
        if name != "plain":
            s = stats[(name, batch)]
            row["mean_acceptance_length"] = round(1 + s["accepted"] / max(s["drafts"], 1), 3)
        out[f"b{batch} {name}"] = row
        print(f"b{batch} {name}: {row}", flush=True)
if args.output:
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
