"""XLA:CPU matmul forms at decode-sized row counts: the dot vs weld's multiply + reduction.

    python benchmarks/cpu_matmul.py [--rows 1,2,4,8,16,32,64] [--out FILE.json]

For each SmolLM2-135M projection shape (weights stored [out, in], as weld keeps them), a jitted
chain of copies of the matrix (~100 MB, so the weights stream from memory, not cache) is run
with x [rows, in] in both forms, interleaved, 7 times; prints the median time per matmul and
the weight bytes streamed per second. `weld.models.common.layers.linear` picks the form.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {"qkv (fused)": (960, 576), "o": (576, 576), "gate_up (fused)": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def form(kind: str):
    def mm(x, w):
        if kind == "packed":  # w is a layers.PackedWeight: the native kernel (benchmarks/cpu_kernels.py)
            from weld.kernels import cpu as cpu_kernels

            return cpu_kernels.packed_matmul(x, w.panels, w.n)
        if kind == "dot":
            return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))
        x, w = jax.lax.optimization_barrier((x, w))
        return jnp.sum(w[:, None, :] * x[None], axis=-1).T
    return mm


def chain(kind: str):
    mm = form(kind)

    @jax.jit
    def run(x, ws):
        acc = jnp.zeros((), x.dtype)
        for w in ws:  # each product feeds the next input, so nothing overlaps or is skipped
            acc = acc + mm(x, w)[:, :4].sum()
            x = x + acc * 1e-9
        return acc
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    results = []
    print(f"{'shape':>16} {'rows':>4} {'dot us':>9} {'reduce us':>9} {'dot GB/s':>8} {'red GB/s':>8} {'speedup':>7}")
    for name, (n_out, n_in) in SHAPES.items():
        copies = max(2, min(40, int(100e6 / (n_out * n_in * 4))))
        ws = [jnp.asarray(rng.standard_normal((n_out, n_in), np.float32)) for _ in range(copies)]
        fns = {kind: chain(kind) for kind in ("dot", "reduce")}
        nbytes = n_out * n_in * 4
        for m in rows:
            x = jnp.ones((m, n_in), jnp.float32)
            times = {kind: [] for kind in fns}
            for fn in fns.values():
                fn(x, ws).block_until_ready()
            for _ in range(args.runs):
                for kind, fn in fns.items():
                    t = time.perf_counter()
                    fn(x, ws).block_until_ready()
                    times[kind].append((time.perf_counter() - t) / copies)
            med = {kind: float(np.median(v)) for kind, v in times.items()}
            results.append({"shape": name, "out": n_out, "in": n_in, "rows": m, "median_s": med})
            print(f"{name:>16} {m:>4} {med['dot'] * 1e6:9.1f} {med['reduce'] * 1e6:9.1f} "
                  f"{nbytes / med['dot'] / 1e9:8.1f} {nbytes / med['reduce'] / 1e9:8.1f} "
                  f"{med['dot'] / med['reduce']:6.2f}x", flush=True)
        del ws
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
