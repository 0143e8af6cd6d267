"""In-process A/B of speculative decoding's device side: one DSpark engine run with another
checkout's `programs.verify` and `DSparkDrafter` ("old") and with this tree's ("new"), each with
a width policy of its own, and a plain engine, in alternating passes over chat.txt (greedy, up
to 128 tokens) at batch 1 and 4; medians of the passes after the first (which compiles). In
one process the host's load hits all three alike, which separate `weld bench` runs on a shared
2-core machine do not.

    git worktree add -f /tmp/basetree <commit>
    python benchmarks/spec_ab_inproc.py /tmp/basetree [PASSES] [OUT.json]

Results: benchmarks/results/spec_dspark_round_2026-12-07.md.
"""
import functools
import importlib.util
import json
import statistics as st
import sys
import time

import numpy as np, jax
from weld.engine.llm import LLM
from weld.engine.sampling_params import SamplingParams
from weld.engine.spec.policy import WidthPolicy

BASE = sys.argv[1]


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod
old_programs = load("old_programs", f"{BASE}/weld/engine/programs.py")
old_drafters = load("old_drafters", f"{BASE}/weld/engine/spec/drafters.py")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
prompts = [l.strip() for l in open("benchmarks/prompts/chat.txt") if l.strip()]
msgs = [[{"role": "user", "content": p}] for p in prompts]
sp = SamplingParams(max_tokens=128, temperature=0)
plain = LLM()
spec = LLM(speculative_config={"method": "dspark"})
r = spec.engine.runner
new_verify = r._verify
sink = new_verify.__wrapped__.keywords["sink"]
old_drafter = old_drafters.DSparkDrafter(r.drafter.cfg, r.drafter.threshold)
old_verify = jax.jit(functools.partial(old_programs.verify, r.family.forward, old_drafter, sink=sink),
                     static_argnames=("cfg", "num_top", "rounds"), donate_argnames=("cache", "draft_state"))
widths = r.spec_widths
policies = {"old": WidthPolicy(widths), "new": WidthPolicy(widths)}
def setup(v):
    if v == "plain": return plain
    r._verify = old_verify if v == "old" else new_verify
    spec.engine.width_policy = policies[v]
    return spec
def run_pass(v, bs):
    llm = setup(v)
    eng = llm.engine
    c0 = eng.runner.num_compiles
    st0 = dict(eng.spec_stats()) if v != "plain" else {}
    t = time.perf_counter(); toks = 0
    for i in range(0, len(msgs), bs):
        outs = llm.chat(msgs[i:i+bs], sp, use_tqdm=False)
        toks += sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.perf_counter() - t
    return toks, dt, eng.runner.num_compiles - c0, [list(o.outputs[0].token_ids) for o in outs]
res = {}
order = ["plain", "old", "new"]
for rep in range(REPS + 1):
    if rep == 1:  # rep 0 compiled both variants' programs under one key set (the runner counted one of
        # each shape), so the policies may have measured compiles: start both afresh
        policies.update(old=WidthPolicy(widths), new=WidthPolicy(widths))
    for v in (order if rep % 2 == 0 else order[::-1]):
        for bs in (1, 4):
            toks, dt, comp, _ = run_pass(v, bs)
            if rep > 0 and comp == 0:
                res.setdefault((v, bs), []).append(toks / dt)
            print(f"rep {rep} {v} b{bs} {toks} tok {dt:.2f}s {toks/dt:.1f} tok/s compiles {comp}", flush=True)
out = {}
for bs in (1, 4):
    p = st.median(res[("plain", bs)])
    for v in ("plain", "old", "new"):
        m = st.median(res[(v, bs)])
        print(f"b{bs} {v:5s} median {m:.1f} tok/s ({len(res[(v, bs)])} passes) = {m/p:.3f}x plain; passes {[round(x,1) for x in res[(v, bs)]]}")
        out[f"b{bs}_{v}"] = {"median_tok_s": m, "passes": res[(v, bs)]}
for v in ("old", "new"):
    spec.engine.width_policy = policies[v]
    print(v, "policy rates", policies[v].table())
if len(sys.argv) > 3:
    json.dump(out, open(sys.argv[3], "w"), indent=1)
