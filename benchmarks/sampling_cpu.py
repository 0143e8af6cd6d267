"""Decode speed with the sampling parameters chat clients send, against greedy, on the real engine.

    python benchmarks/sampling_cpu.py [--batch-size 1] [--tokens 200] [--rounds 3] [--out FILE.json]

One chat prompt (repeated --batch-size times), exactly --tokens new tokens (`ignore_eos`), under
greedy decoding and under temperature with top_p or top_k. The configurations alternate within
each round, so that the machine's drift falls on all of them alike; the table gives the median
tok/s of the rounds and the ratio to greedy. The filters' cost is the sampler's: see
`weld/engine/sampler.py: filter_logits`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from weld import LLM, SamplingParams
from weld.bench.roofline import machine_info

PROMPT = "Write a long story about a dragon who learns to bake bread."
CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 1.0, top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "temperature 0.8, top_k 40": dict(temperature=0.8, top_k=40),
    # flat rows: nuclei of thousands of tokens, past the sampler's first candidates
    "temperature 1.5, top_p 0.95": dict(temperature=1.5, top_p=0.95),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not (1 <= args.batch_size <= 256 and 1 <= args.tokens <= 2048 and 1 <= args.rounds <= 100):
        ap.error("--batch-size 1..256, --tokens 1..2048, --rounds 1..100")
    load = os.getloadavg()
    llm = LLM(max_num_seqs=args.batch_size, max_model_len=args.tokens + 128, progress=False)
    messages = [[{"role": "user", "content": PROMPT}]] * args.batch_size

    def params(kw: dict, seed: int) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=seed + i, **kw)
                for i in range(args.batch_size)]

    for kw in CONFIGS.values():  # compile every program first
        llm.chat(messages, params(kw, 0), use_tqdm=False)
    rates = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name, kw in CONFIGS.items():
            t = time.perf_counter()
            outs = llm.chat(messages, params(kw, 1000 * (r + 1)), use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    base = statistics.median(rates["greedy"])
    print(f"batch {args.batch_size}, {args.tokens} tokens, median of {args.rounds} alternating rounds")
    for name, values in rates.items():
        print(f"  {name:30s} {statistics.median(values):8.1f} tok/s  {statistics.median(values) / base:5.2f}x greedy")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(load),
                       "batch_size": args.batch_size, "tokens": args.tokens, "rounds": args.rounds,
                       "tok_s": rates}, f, indent=1)


if __name__ == "__main__":
    main()
