"""Device time of the parts of a DSpark round on the bundled model, each part run 32 times inside
one jitted loop (the cache and drafter state donated and carried, as the engine's loop carries
them), in decode steps of the same process: a decode step, with the drafter's `observe`, a
verification forward of s tokens a row (+ observe), and the drafter's `propose` at k drafts
(with its head and Markov loop, and without: threshold above any confidence).

    python benchmarks/dspark_round_parts.py [BATCH]    # default batch 1

Results: benchmarks/results/spec_dspark_round_2026-12-07.md.
"""
import functools
import sys
import time

import numpy as np, jax, jax.numpy as jnp
from weld.engine.llm import LLM
from weld.engine.spec.drafters import DSparkDrafter
from weld.models.common.cache import AttentionBatch

B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
N = 32
llm = LLM(speculative_config={"method": "dspark"})
r = llm.engine.runner
fwd = r.family.forward
cfg, W, DP = r.cfg, r.weights, r.draft_params
drafter = r.drafter
P = r.max_pages_per_seq
tables = jnp.asarray(np.stack([np.arange(P) + b * P for b in range(B)]).astype(np.int32))
pos0 = 200
batch = AttentionBatch(block_tables=tables)
cap = drafter.capture_layers

def loop(step):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def run(cache, dstate):
        def body(i, c):
            out = step(i, c[0], c[1])
            return (out[0], out[1], c[2] + (out[2] if len(out) > 2 else 0))
        c = jax.lax.fori_loop(0, N, body, (cache, dstate, jnp.int32(0)))
        return c[0], c[1], c[2]
    return run

def used(logits):
    """The logits' greedy ids summed into the loop's carry: without a use, XLA drops the LM head."""
    return jnp.sum(jnp.argmax(logits, axis=-1))

def dec(capture):
    def step(i, cache, dstate):
        tok = jnp.full((B, 1), 5, jnp.int32) + i
        pos = jnp.full((B, 1), pos0, jnp.int32)
        logits, feats, cache = fwd(W, cfg, tok, pos, cache, batch, jnp.zeros((B, 1), jnp.int32), capture_layers=cap if capture else ())
        if capture:
            dstate = drafter.observe(DP, dstate, (tok,), (pos,), (tables,), (jnp.zeros((B,), jnp.int32),), (feats,))
        return cache, dstate, used(logits)
    return step

def ver(s, capture=True):
    def step(i, cache, dstate):
        tok = jnp.full((B, s), 5, jnp.int32) + i
        pos = jnp.full((B, s), pos0, jnp.int32) + jnp.arange(s)
        logits, feats, cache = fwd(W, cfg, tok, pos, cache, batch, capture_layers=cap if capture else ())
        if capture:
            dstate = drafter.observe(DP, dstate, (tok,), (pos,), (tables,), (jnp.zeros((B,), jnp.int32),), (feats,))
        return cache, dstate, used(logits)
    return step

def prop(k, threshold):
    d = DSparkDrafter(drafter.cfg, threshold)
    def step2(i, cache, dstate):
        last = jnp.full((B,), 5, jnp.int32) + i
        dstate2, drafts, num = d.propose(DP, dstate, W, last, jnp.full((B,), pos0, jnp.int32), tables,
                                        jnp.full((B,), 64, jnp.int32), k)
        # keep drafts alive
        return cache, dstate2, jnp.sum(drafts) + jnp.sum(num)  # summed into the carry: not pruned
    return step2

unused = lambda step: (lambda i, cache, dstate: step(i, cache, dstate)[:2])
parts = {"decode": dec(False), "decode+observe": dec(True), "decode, logits unused": unused(dec(False))}
for s in (2, 4, 8):
    parts[f"verify{s}+observe"] = ver(s)
    parts[f"verify{s}"] = ver(s, False)
for k in (1, 3, 7):
    parts[f"propose k{k} head"] = prop(k, 0.0)
parts["propose k7 nohead"] = prop(7, 1.01)
progs = {n: loop(s) for n, s in parts.items()}
times = {n: [] for n in progs}
for rep in range(6):
    for n, p in progs.items():
        t = time.perf_counter()
        r.cache, r.draft_state, _x = p(r.cache, r.draft_state)
        jax.block_until_ready(r.cache)
        if rep: times[n].append((time.perf_counter() - t) / N * 1e3)
base = np.median(times["decode"])
for n, v in times.items():
    print(f"B={B} {n:22s} {np.median(v):7.2f} ms  ({np.median(v)/base:.2f}x decode)")
