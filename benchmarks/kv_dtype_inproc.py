"""The KV pool's element type side by side in one process: an engine per `--kv-cache-dtype`,
alternating passes of greedy decoding on the bundled model (chat.txt's prompts, chat template,
128 new tokens, EOS ignored) at batch 1 and 16 (the prompts repeated to fill the batch); medians
of the passes after the first two (which compile: the first timed pass still did). In one process the host's load hits every
engine alike.

    python benchmarks/kv_dtype_inproc.py [--passes 4] [--output FILE.json] [DTYPE ...]   # default: float32 float16
"""
import argparse
import json
import statistics
import time

from weld.engine.llm import LLM
from weld.engine.sampling_params import SamplingParams

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("dtypes", nargs="*", default=["float32", "float16"], help="KV pool dtypes (default: float32 float16)")
ap.add_argument("--passes", type=int, default=4, help="timed passes per engine and batch size (default: 4)")
ap.add_argument("--output", default=None, help="write the medians as JSON here")
args = ap.parse_args()
if not 1 <= args.passes <= 50:
    ap.error(f"--passes must be in [1, 50], got {args.passes}")
prompts = [line.strip() for line in open("benchmarks/prompts/chat.txt") if line.strip()]
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
engines = {d: LLM(kv_cache_dtype=d, max_num_seqs=16, max_model_len=1024, progress=False) for d in args.dtypes}
speeds: dict = {}
WARM = 2
for rep in range(args.passes + WARM):
    for name in (args.dtypes if rep % 2 == 0 else args.dtypes[::-1]):
        for batch in (1, 16):
            group = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(batch)]
            start = time.perf_counter()
            tokens = sum(len(o.outputs[0].token_ids) for o in engines[name].chat(group, params, use_tqdm=False))
            rate = tokens / (time.perf_counter() - start)
            if rep >= WARM:
                speeds.setdefault(f"b{batch} {name}", []).append(round(rate, 1))
            print(f"pass {rep} {name} b{batch}: {tokens} tokens, {rate:.1f} tok/s", flush=True)
out = {key: {"median_tok_s": statistics.median(v), "passes": v} for key, v in speeds.items()}
for batch in (1, 16):
    base = out[f"b{batch} {args.dtypes[0]}"]["median_tok_s"]
    for name in args.dtypes:
        out[f"b{batch} {name}"]["vs_first"] = round(out[f"b{batch} {name}"]["median_tok_s"] / base, 3)
print(json.dumps(out, indent=1))
if args.output:
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
