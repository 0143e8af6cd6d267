"""On a GPU (or TPU): does XLA fuse the int8 weights' convert into the matmul, and what share of
the memory bandwidth do int8-per-channel decode matmuls reach against bf16 ones?

    python benchmarks/gpu_int8_check.py [--n 8192] [--k 8192] [--rows 1,4,16] [--out FILE.json]

1. The HLO check of tests/models/test_layers.py::test_int8_channel_matmul_materializes_no_float_weights
   on this backend: `layers.linear` of bf16 activations and an "int8_channel" QuantWeight must
   leave no float [n, k] buffer in the optimized program (the convert lives inside the matmul's
   fusion). Exits 1 when one is there.
2. For each row count: the median time of a chain of matmuls over distinct weights (more bytes
   than the cache), bf16 weights against int8 codes + f32 scales, and the bandwidth it implies
   (weight bytes / time). int8 should approach half the bf16 time.
Needs a device (the CPU backend materializes the convert by design); it writes no file unless --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common import layers, quant


def float_buffers(hlo: str, n: int, k: int) -> list[str]:
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    return [line.strip() for line in entry.splitlines() if re.search(rf"= (f32|bf16|f16)\[{n},{k}\]", line)]


def median_s(fn, *args, runs: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--copies", type=int, default=8, help="distinct weight matrices per timed chain")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n, k = args.n, args.k
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((n, k), np.float32) * 0.02 for _ in range(args.copies)]
    q = [quant.quantize(w, "int8_channel") for w in host]
    bf = [jnp.asarray(w, jnp.bfloat16) for w in host]
    x = jnp.ones((1, k), jnp.bfloat16)
    hlo = jax.jit(layers.linear).lower(x, q[0]).compile().as_text()
    buffers = float_buffers(hlo, n, k)
    result = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "n": n, "k": k,
              "fused": not buffers, "float_buffers": buffers, "rows": {}}
    print(f"{result['device']}: int8 convert fused into the matmul: {result['fused']}")

    def chain(x, ws):
        y = jnp.zeros((x.shape[0], n), jnp.float32)
        for w in ws:
            y = y + layers.linear(x, w).astype(jnp.float32)
        return y

    run = jax.jit(chain)
    for m in (int(r) for r in args.rows.split(",")):
        xm = jnp.ones((m, k), jnp.bfloat16)
        t_bf, t_q = median_s(run, xm, bf), median_s(run, xm, q)
        bytes_bf = args.copies * n * k * 2
        bytes_q = args.copies * (n * k + 4 * n)
        row = {"bf16_ms": t_bf * 1e3, "int8_ms": t_q * 1e3, "bf16_GBps": bytes_bf / t_bf / 1e9,
               "int8_GBps": bytes_q / t_q / 1e9, "speedup": t_bf / t_q}
        result["rows"][m] = row
        print(f"rows {m:3d}: bf16 {row['bf16_ms']:.3f} ms ({row['bf16_GBps']:.0f} GB/s), int8 {row['int8_ms']:.3f} ms "
              f"({row['int8_GBps']:.0f} GB/s), int8 {row['speedup']:.2f}x faster")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["fused"] else 1


if __name__ == "__main__":
    sys.exit(main())
