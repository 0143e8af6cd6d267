"""The drafter's teacher on an accelerator, piece by piece, at train-draft's step shape (16 answers
x 448 tokens, SmolLM2-135M's config, random f32 weights): the target's forward at each matmul
precision, the LM head, and the top-32 over 49,152 tokens by lax.top_k, by `train.top_k_by_chunks`
(checked equal) and by approx_max_k (its recall); then the whole teacher (`train._teacher`).
Medians of 5 calls after the first (which compiles).

    python benchmarks/teacher_tpu.py [--rows 16] [--output FILE.json]

Results: benchmarks/results/teacher_tpu_2026-12-07.json (TPU v5e; the "teacher_as_committed"
there is the teacher before top_k_by_chunks)."""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from weld.models import llama
from weld.models.common.spec import random_weights
from weld.engine.spec.features import target_hidden_states
from weld.engine.spec import train as T

CFG = llama.Config(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                   max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--rows", type=int, default=16, help="answers per step (default: 16)")
ap.add_argument("--output", default=None, help="write the timings here as JSON")
args = ap.parse_args()
if not 1 <= args.rows <= 256:
    ap.error(f"--rows must be in [1, 256], got {args.rows}")
B, L, TOP = args.rows, 448, 32
res = {"devices": str(jax.devices()), "shape": [B, L]}


def timed(name, fn, *args, reps=5):
    t = time.time(); out = jax.block_until_ready(fn(*args)); c = time.time() - t
    ts = []
    for _ in range(reps):
        t = time.time(); jax.block_until_ready(fn(*args)); ts.append(time.time() - t)
    res[name] = {"first_s": round(c, 2), "median_ms": round(1e3 * float(np.median(ts)), 2)}
    print(name, res[name], flush=True)
    return out


w = jax.device_put(random_weights(llama.weight_specs(CFG), seed=0, scale=0.5))
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 49152, (B, L)), jnp.int32)
layers = (1, 14, 26)
for prec in ("default", "high", "highest"):
    @jax.jit
    def fwd(w, tokens, prec=prec):
        with jax.default_matmul_precision(prec):
            return target_hidden_states(llama, w, CFG, tokens, layers)
    feats, final = timed(f"forward_{prec}", fwd, w, tokens)
for prec in ("default", "highest"):
    @jax.jit
    def head(w, final, prec=prec):
        with jax.default_matmul_precision(prec):
            return jax.nn.softmax(llama.lm_head(w, CFG, final).astype(jnp.float32), axis=-1)
    probs = timed(f"lm_head_softmax_{prec}", head, w, final)
flat = probs.reshape(-1, probs.shape[-1])
ref = timed("lax_top_k", jax.jit(lambda p: jax.lax.top_k(p, TOP)), flat)
for c in (64, 128, 256):
    got = timed(f"chunked_top_k_{c}", jax.jit(functools.partial(T.top_k_by_chunks, k=TOP, chunk=c)), flat)
    res[f"chunked_top_k_{c}"]["equal"] = bool(jnp.all(got[0] == ref[0]))
got = timed("approx_max_k", jax.jit(lambda p: jax.lax.approx_max_k(p, TOP)), flat)
res["approx_max_k"]["recall"] = float(np.mean([len(set(a) & set(b)) / TOP for a, b in zip(np.asarray(got[1])[:512], np.asarray(ref[1])[:512])]))
teach = jax.jit(functools.partial(T._teacher, llama), static_argnames=("cfg", "layers", "top"))
timed("teacher", lambda w, t: teach(w, cfg=CFG, tokens=t, layers=layers, top=TOP), w, tokens)
if args.output:
    with open(args.output, "w") as f:
        json.dump(res, f, indent=1)
