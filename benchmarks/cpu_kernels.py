"""weld's native CPU kernels against the XLA forms they replace, in one process, interleaved.

    python benchmarks/cpu_kernels.py [--batches 1,4,16] [--rows 1,4,16,64] [--runs 7] [--out FILE.json]

1. Paged decode attention over 30 layers (SmolLM2-135M's 9 heads, 3 kv heads, head dim 64,
   16-token pages, every row at position --position), 8 decode steps per call: the native
   kernel (weld/kernels/cpu/paged_attention.cc) vs the jnp path (WELD_CPU_KERNELS=0 when traced).
2. Each SmolLM2 projection shape over --rows rows, a chain of copies (~100 MB, so the weights come
   from memory): the packed kernel (matmul.cc) vs XLA's dot and weld's multiply + reduction.

Prints medians per step / per matmul and writes them as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_matmul import chain as matmul_chain  # the same chained-copies harness, plus the "packed" form
from weld.kernels import cpu as cpu_kernels
from weld.models.common import attention, layers

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 30, 9, 3, 64, 16
SHAPES = {"qkv (fused)": (960, 576), "o": (576, 576), "gate_up (fused)": (3072, 576), "down": (576, 1536)}


def median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def attention_program(kernel: bool, b: int, position: int):
    """8 decode steps of attention over 30 layers' pools, traced with the kernel on or off."""
    os.environ["WELD_CPU_KERNELS"] = "1" if kernel else "0"
    pages_per_row = position // PAGE + 2
    pool = (b * pages_per_row + 1, PAGE, KV_HEADS * HEAD_DIM)
    tables = jnp.asarray(np.arange(b * pages_per_row, dtype=np.int32).reshape(b, pages_per_row))
    positions = jnp.full((b, 1), position, jnp.int32)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, 1, HEADS, HEAD_DIM), np.float32))
    k = jnp.asarray(rng.standard_normal((b, 1, KV_HEADS, HEAD_DIM), np.float32))

    def run(q, k_pools, v_pools):
        def step(_, carry):
            q, k_pools, v_pools = carry
            new_k, new_v = [], []
            for kp, vp in zip(k_pools, v_pools):
                out, kp, vp = attention.paged_attention(q, k, k, kp, vp, positions, tables)
                q = q + 1e-3 * out
                new_k.append(kp)
                new_v.append(vp)
            return q, new_k, new_v
        return jax.lax.fori_loop(0, 8, step, (q, k_pools, v_pools))

    fn = jax.jit(run, donate_argnums=(1, 2))
    state = {"k": [jnp.asarray(rng.standard_normal(pool, np.float32)) for _ in range(LAYERS)],
             "v": [jnp.asarray(rng.standard_normal(pool, np.float32)) for _ in range(LAYERS)]}

    def call():
        out, state["k"], state["v"] = fn(q, state["k"], state["v"])
        return out
    call()  # compile now, under this setting of the switch
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--position", type=int, default=192, help="context of every row (the bench's mean)")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"the native CPU kernels are not available: {cpu_kernels._state.get('error')}")
    results = {"jax": jax.__version__, "attention": [], "matmul": []}
    print(f"attention, {LAYERS} layers, position {args.position}: ms per decode step (median of {args.runs})")
    for b in [int(v) for v in args.batches.split(",")]:
        fns = {"jnp": attention_program(False, b, args.position), "kernel": attention_program(True, b, args.position)}
        times = {name: [] for name in fns}
        for _ in range(args.runs):
            for name, fn in fns.items():
                times[name].append(median_s(fn, 1) / 8)
        med = {name: float(np.median(v)) for name, v in times.items()}
        results["attention"].append({"batch": b, "median_s_per_step": med})
        print(f"  batch {b:3d}: jnp {med['jnp'] * 1e3:7.2f}  kernel {med['kernel'] * 1e3:7.2f}  "
              f"({med['jnp'] / med['kernel']:.1f}x)", flush=True)
    os.environ.pop("WELD_CPU_KERNELS", None)

    rng = np.random.default_rng(0)
    print("projections: weight GB/s (higher is better)")
    for name, (n_out, n_in) in SHAPES.items():
        copies = max(2, min(40, int(100e6 / (n_out * n_in * 4))))
        plain = [jnp.asarray(rng.standard_normal((n_out, n_in), np.float32)) for _ in range(copies)]
        packed = [layers.pack_weight(w) for w in plain]
        fns = {form: matmul_chain(form) for form in ("dot", "reduce", "packed")}
        weights = {"dot": plain, "reduce": plain, "packed": packed}
        for m in [int(v) for v in args.rows.split(",")]:
            x = jnp.ones((m, n_in), jnp.float32)
            for form, fn in fns.items():
                fn(x, weights[form]).block_until_ready()
            times = {form: [] for form in fns}
            for _ in range(args.runs):
                for form, fn in fns.items():
                    times[form].append(median_s(lambda: fn(x, weights[form]), 1) / copies)
            med = {form: float(np.median(v)) for form, v in times.items()}
            results["matmul"].append({"shape": name, "out": n_out, "in": n_in, "rows": m, "median_s": med})
            gbs = {form: n_out * n_in * 4 / t / 1e9 for form, t in med.items()}
            print(f"  {name:>16} {m:3d} rows: dot {gbs['dot']:5.1f}  reduce {gbs['reduce']:5.1f}  "
                  f"packed {gbs['packed']:5.1f}", flush=True)
        del plain, packed
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
