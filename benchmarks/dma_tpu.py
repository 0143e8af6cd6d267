"""What one KV-page DMA costs on a TPU chip: HBM -> VMEM copies of one page each (from random
pages of 2,048), `depth` in flight, for page shapes [page, KV, E] (the pools' layout) and
[page, KV * E] (the heads folded into the lanes): median microseconds per copy (the difference
of two call sizes: no dispatch in it) and GB/s of useful bytes. Tells a fixed per-DMA cost (the
megakernel's attention issues one per page per row) from the tile padding of narrow pages.

    PYTHONPATH=.:benchmarks python benchmarks/dma_tpu.py --out results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu



def median_ms(fn, *args, reps=30):
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def dma_copies(index, pool, depth):
    """Copy pool[index[i]] for every i into a ring of `depth` VMEM slots, `depth` copies in flight."""
    n = index.shape[0]

    def kernel(idx_ref, pool_ref, out_ref, buf, sems):
        def copy(i):
            return pltpu.make_async_copy(pool_ref.at[idx_ref[i]], buf.at[i % depth], sems.at[i % depth])

        for i in range(min(depth, n)):
            copy(i).start()

        def body(i, _):
            copy(i).wait()

            @pl.when(i + depth < n)
            def _():
                copy(i + depth).start()

        jax.lax.fori_loop(0, n, body, None)
        out_ref[...] = buf[0].astype(jnp.float32)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape[1:], jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pltpu.MemorySpace.VMEM),
            scratch_shapes=[pltpu.VMEM((depth,) + pool.shape[1:], pool.dtype), pltpu.SemaphoreType.DMA((depth,))]),
    )(index, pool)


def dma_rows(copies=(256, 16384), pages=2048):
    """Per page shape and depth: the call with copies[0] copies and with copies[1], and the
    difference per copy (what one more copy costs, the call's dispatch taken out)."""
    rows = []
    rng = np.random.default_rng(0)
    for shape in ((16, 3, 64), (16, 192), (64, 3, 64), (64, 192), (128, 3, 64), (128, 192), (16, 8, 128),
                  (16, 1024), (64, 8, 128)):
        pool = jnp.ones((pages,) + shape, jnp.bfloat16)
        for depth in (2, 8, 16):
            fn = jax.jit(functools.partial(dma_copies, depth=depth))
            ms = [median_ms(fn, jnp.asarray(rng.integers(0, pages, n), jnp.int32), pool, reps=10) for n in copies]
            per_copy = (ms[1] - ms[0]) / (copies[1] - copies[0])
            useful = int(np.prod(shape)) * 2
            rows.append(dict(page_shape=list(shape), depth=depth, copies=list(copies), call_ms=[round(m, 4) for m in ms],
                             us_per_copy=round(per_copy * 1e3, 4), useful_gb_s=round(useful / per_copy / 1e6, 1)))
            print("dma", rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, dma=dma_rows())
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
