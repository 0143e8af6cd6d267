"""On a GPU: one XLA decode step of a Llama-3.2-1B-shaped model (random bf16 weights), its time
and the share of the memory bandwidth it reaches, at several batch sizes.

    python benchmarks/gpu_decode_check.py [--batches 1,16] [--context 1024] [--out FILE.json]

The step is the family's forward (`llama.forward`: one token per row over paged K/V, every row
at position context - 1, so each reads `context` tokens of K/V per layer), jitted with the cache
donated, as the engine's decode program calls it once per step. Bytes per step: every weight
once, plus each row's K/V read and the new K/V written; bandwidth = bytes / median time. The
device's copy bandwidth is measured in the same run (a device-to-device copy of 4 GB) as the
ceiling. Writes no file unless --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from weld.models import llama
from weld.models.common.cache import AttentionBatch
from weld.models.common.spec import iter_specs, map_specs

# Llama-3.2-1B's shapes (tied embedding)
CFG = llama.Config(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                   num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=5e5, tie_word_embeddings=True)
PAGE = 16


def median_s(fn, runs: int = 20) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth() -> float:
    x = jnp.ones((1 << 30,), jnp.float32)  # 4 GB
    copy = jax.jit(lambda a: a + 0.0)
    t = median_s(lambda: jax.block_until_ready(copy(x)), runs=10)
    return 2 * x.nbytes / t  # read + write


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 1000))

    def init(_, spec):
        if spec.init == "ones":
            return jnp.ones(spec.shape, jnp.bfloat16)
        return (jax.random.normal(next(keys), spec.shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    weights = map_specs(init, llama.weight_specs(CFG))
    weight_bytes = sum(math.prod(s.shape) * 2 for _, s in iter_specs(llama.weight_specs(CFG)))
    result = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "model": "Llama-3.2-1B shapes, random bf16", "weight_bytes": weight_bytes, "context": args.context,
              "copy_GBps": copy_bandwidth() / 1e9, "batches": {}}
    print(f"{result['device']} (jax {jax.__version__}): copy {result['copy_GBps']:.0f} GB/s; "
          f"weights {weight_bytes / 1e9:.2f} GB")
    step = jax.jit(lambda w, t, p, c, bt: llama.forward(w, CFG, t, p, c, AttentionBatch(bt)), donate_argnums=(3,))
    kv_token = CFG.num_layers * 2 * CFG.num_kv_heads * CFG.head_dim * 2  # bytes of one token's K/V, all layers
    for b in (int(x) for x in args.batches.split(",")):
        per_row = -(-args.context // PAGE)
        cache = llama.cache_spec(CFG).create(b * per_row, PAGE, jnp.bfloat16)
        tables = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)
        tokens = jnp.ones((b, 1), jnp.int32)
        positions = jnp.full((b, 1), args.context - 1, jnp.int32)
        state = {"cache": cache}

        def once():
            logits, _, state["cache"] = step(weights, tokens, positions, state["cache"], tables)
            jax.block_until_ready(logits)

        t = median_s(once)
        moved = weight_bytes + b * (args.context + 1) * kv_token
        row = {"step_ms": t * 1e3, "tok_per_s": b / t, "bytes_per_step": moved, "GBps": moved / t / 1e9,
               "share_of_copy": moved / t / (result["copy_GBps"] * 1e9)}
        result["batches"][b] = row
        print(f"batch {b:3d}: {row['step_ms']:.3f} ms/step, {row['tok_per_s']:.0f} tok/s, "
              f"{row['GBps']:.0f} GB/s = {row['share_of_copy']:.0%} of the copy bandwidth")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
