"""The native CPU paged attention kernel alone, at the query blocks the engine hands it: a decode
step (1 query a row), a verification (k + 1 queries of one row), batched decoding and a prefill
chunk.

    python benchmarks/attention_cpu.py [--cases 1x1,1x5,1x8,4x5,16x1,1x1024] [--context 200] [--runs 30] [--out F]

A case BxT is B rows of T consecutive queries after --context tokens (a prefill case, T >= 256,
starts at 0), SmolLM2-135M's heads (9 query heads on 3 kv heads of 64), 16-token pages in a
random order, f32 pools. One jitted chain calls the kernel 30 times (a model's layers, each
call's output feeding the next), so the figure is the median microseconds of one call.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from weld.bench.roofline import machine_info
from weld.kernels import cpu as cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30
MAX_ROWS, MAX_QUERIES, MAX_CONTEXT, MAX_RUNS = 64, 4096, 32768, 1000


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        b, _, t = item.partition("x")
        if not (b.isdigit() and t.isdigit()) or not (1 <= int(b) <= MAX_ROWS and 1 <= int(t) <= MAX_QUERIES):
            raise SystemExit(f"--cases: {item!r} is not BxT with 1 <= B <= {MAX_ROWS}, 1 <= T <= {MAX_QUERIES}")
        cases.append((int(b), int(t)))
    return cases


def setup(b: int, t: int, context: int, rng: np.random.Generator):
    start = 0 if t >= 256 else context
    blocks = -(-(start + t) // PAGE)
    pages = b * blocks
    pool = lambda: jnp.asarray(rng.standard_normal((pages, PAGE, KV_HEADS * HEAD_DIM)), jnp.float32)  # noqa: E731
    tables = jnp.asarray(rng.permutation(pages).reshape(b, blocks).astype(np.int32))
    positions = jnp.asarray(np.tile(np.arange(start, start + t, dtype=np.int32), (b, 1)))
    q = jnp.asarray(rng.standard_normal((b, t, HEADS, HEAD_DIM)), jnp.float32)
    return q, pool(), pool(), tables, positions


@jax.jit
def chain(q, k_pool, v_pool, tables, positions):
    def layer(_, q):
        out, _ = cpu_kernels.paged_attention(q, k_pool, v_pool, tables, positions, scale=HEAD_DIM ** -0.5,
                                             sliding_window=None)
        return 0.5 * (out + q)
    return jax.lax.fori_loop(0, LAYERS, layer, q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1x1,1x5,1x8,4x5,16x1,1x1024")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    cases = parse_cases(args.cases)
    if not 0 <= args.context <= MAX_CONTEXT or not 1 <= args.runs <= MAX_RUNS:
        raise SystemExit(f"--context must be in [0, {MAX_CONTEXT}] and --runs in [1, {MAX_RUNS}]")
    if not cpu_kernels.available():
        raise SystemExit("the native CPU kernels are unavailable here (WELD_CPU_KERNELS, a compiler, a CPU backend)")
    load = os.getloadavg()
    rng = np.random.default_rng(0)
    results = []
    for b, t in cases:
        args_ = setup(b, t, args.context, rng)
        chain(*args_).block_until_ready()
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            chain(*args_).block_until_ready()
            times.append(time.perf_counter() - start)
        us = float(np.median(times)) / LAYERS * 1e6
        results.append({"rows": b, "queries": t, "us_per_call": round(us, 1)})
        print(f"{b:3d} rows x {t:5d} queries: {us:9.1f} us per call")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"context": args.context, "runs": args.runs, "machine": machine_info(load), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
