"""The engine's device calls on chat.txt (greedy, up to 128 tokens, in groups of BATCH), after a
warm-up pass: per (kind, width, rows) the calls, the median call, tokens per call, and for
verification calls the rounds, drafts sent and accepted per round, ms per round and a histogram
of the drafts a row sent in a round; then the policy's rates and the engine's spec stats.

    python benchmarks/dspark_round_stats.py dspark 1 '{"adaptive": false, "num_speculative_tokens": 7}'
    python benchmarks/dspark_round_stats.py none 1        # plain decoding
    REPS=2 python benchmarks/dspark_round_stats.py dspark 4

Run from the repository root. Results: benchmarks/results/spec_dspark_round_2026-12-07.md.
"""
import collections
import json
import os
import sys
import time

import numpy as np
from weld.engine.llm import LLM
from weld.engine.sampling_params import SamplingParams

spec = sys.argv[1] if len(sys.argv) > 1 else "dspark"
bs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
prompts = [l.strip() for l in open(os.path.join(os.getcwd(), "benchmarks/prompts/chat.txt")) if l.strip()]
cfg = None if spec == "none" else {"method": spec, **extra}
llm = LLM(speculative_config=cfg)
tok = llm.get_tokenizer()
core = llm.engine if hasattr(llm, "engine") else llm.core
runner = core.runner
log = []
orig = runner.execute
def timed(plan, **kw):
    t = time.perf_counter(); c = runner.num_compiles
    r = orig(plan, **kw)
    dt = time.perf_counter() - t
    log.append((plan.kind, plan.spec_width, len(plan.entries), dt, int(np.sum(r.token_ids >= 0)), runner.num_compiles - c,
                None if r.num_drafts is None else (r.num_drafts.copy(), r.num_accepted.copy())))
    return r
runner.execute = timed
sp = SamplingParams(max_tokens=128, temperature=0)
msgs = [[{"role": "user", "content": p}] for p in prompts]
# warm
llm.chat(msgs[:bs], sp, use_tqdm=False) if bs else None
for rep in range(int(os.environ.get("REPS", "1"))):
  for i in range(0, len(msgs), bs):
    llm.chat(msgs[i:i+bs], sp, use_tqdm=False)
log2 = [x for x in log if x[5] == 0 and x[0] != "prefill"]
by = collections.defaultdict(list)
for k, w, n, dt, t, c, d in log2:
    by[(k, w, n)].append((dt, t, d))
tot_t = sum(x[3] for x in log2); tot_tok = sum(x[4] for x in log2)
print(f"spec={spec} bs={bs} decode/verify calls={len(log2)} time={tot_t:.2f}s tokens={tot_tok} -> {tot_tok/tot_t:.1f} tok/s")
for key, v in sorted(by.items()):
    dts = np.array([a for a, _, _ in v]); toks = np.array([b for _, b, _ in v])
    rounds = sent = acc = 0
    for _, _, d in v:
        if d is not None:
            s, a = d; m = s >= 0; rounds += m.sum(); sent += s[m].sum(); acc += a[m].sum()
    hist = collections.Counter()
    for _, _, d in v:
        if d is not None:
            s_, a_ = d
            for x in s_[s_ >= 0].ravel(): hist[int(x)] += 1
    print("   sent histogram", dict(sorted(hist.items())))
    print(key, f"calls={len(v)} med_call={np.median(dts)*1e3:.1f}ms tok/call={toks.mean():.2f} tok/s={toks.sum()/dts.sum():.1f}",
          f"rounds={rounds} sent/round={sent/max(rounds,1):.2f} acc/round={acc/max(rounds,1):.2f} ms/round={dts.sum()/max(rounds,1)*1e3:.2f}")
print(core.width_policy.table() if hasattr(core, "width_policy") else "")
print({k: v for k, v in core.spec_stats().items()} if cfg else "")
