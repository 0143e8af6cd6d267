"""The megakernel's paged attention on a TPU chip, alone: one decode token per row over a paged KV
cache, `layers` calls chained in one program (the next call's queries are the last one's
output), timed at two depths so the program's dispatch drops out: median microseconds per
layer. The shapes are real models' (heads over KV heads of a head width), the pools [P, page,
KV x E] hold `--pool-pages` pages each, row-major as the engine keeps them for the megakernel,
each row's pages scattered among them.

Variants: "kernel" is `attention.paged_decode_attention` (`attend_rows`, the megakernel's tile
loop, in a call of its own); "xla" is `paged_decode_attention_reference` jitted (XLA's gathers
over each row's whole block table).

    PYTHONPATH=.:benchmarks python benchmarks/attention_tpu.py --out results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dma_tpu import median_ms
from weld.kernels.megakernel import attention
from weld.models.common import sharding

PAGE = 16
SHAPES = {  # query heads, KV heads, head width, sliding window
    "SmolLM2-135M (9 over 3 of 64)": (9, 3, 64, None),
    "Llama-3-8B (32 over 8 of 128)": (32, 8, 128, None),
    "Gemma-3-270M (4 over 1 of 256)": (4, 1, 256, None),
    "Qwen3-30B-A3B (32 over 4 of 128)": (32, 4, 128, None),
    "gpt-oss-20b sliding (64 over 8 of 64, window 128)": (64, 8, 64, 128),
}


def _row_major_put(x):
    """x row-major on the chip, as the engine places the megakernel's pools (`sharding.row_major`)."""
    from jax.experimental.layout import Format
    from jax.sharding import SingleDeviceSharding

    if jax.default_backend() != "tpu":
        return x
    return jax.device_put(x, Format(sharding.row_major(x.ndim), SingleDeviceSharding(jax.devices()[0])))


def make_case(heads, kv_heads, e, batch, context, pool_pages, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    per_row = context // PAGE + 1
    pages = max(pool_pages, batch * per_row)
    tables = rng.permutation(pages)[:batch * per_row].reshape(batch, per_row).astype(np.int32)
    k = jax.random.normal(jax.random.key(seed), (pages, PAGE, kv_heads * e), dtype)
    v = jax.random.normal(jax.random.key(seed + 1), (pages, PAGE, kv_heads * e), dtype)
    q = jax.random.normal(jax.random.key(seed + 2), (batch, heads, e), jnp.float32)
    kn = jax.random.normal(jax.random.key(seed + 3), (batch, kv_heads, e), dtype)
    vn = jax.random.normal(jax.random.key(seed + 4), (batch, kv_heads, e), dtype)
    positions = jnp.full((batch,), context, jnp.int32)
    return q, kn, vn, k, v, positions, jnp.asarray(tables)


def chained(step, layers):
    """`layers` attention calls in one program, each one's queries the last one's output."""
    def run(q, kn, vn, k, v, positions, tables):
        def body(_, carry):
            q, k, v = carry
            out, k, v = step(q, kn, vn, k, v, positions, tables)
            return out.astype(q.dtype), k, v
        return jax.lax.fori_loop(0, layers, body, (q, k, v))
    return jax.jit(run)  # no donation: every timed call reads the same pools (their copy is in both depths)


def max_error(step, case, window):
    """The step's output against the jnp reference's on the case (relative to its largest)."""
    q, kn, vn, k, v, positions, tables = case
    got = jax.jit(step)(q, kn, vn, _row_major_put(k + 0), _row_major_put(v + 0), positions, tables)[0]
    want = jax.jit(functools.partial(attention.paged_decode_attention_reference, sliding_window=window))(
        q, kn, vn, k, v, positions, tables)[0]
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def time_variant(step, case, depths=(2, 18)):
    q, kn, vn, k, v, positions, tables = case
    ms = []
    for layers in depths:
        fn = chained(step, layers)
        kk, vv = _row_major_put(k + 0), _row_major_put(v + 0)
        ms.append(median_ms(lambda *a: fn(*a)[0], q, kn, vn, kk, vv, positions, tables, reps=10))
    return (ms[1] - ms[0]) / (depths[1] - depths[0]) * 1e3, ms


def variants(tiles, depths, window, interpret=False):
    """name -> (pages per tile, ring depth, the step): the kernel at each tile and depth, then XLA's."""
    out = {f"kernel {ppt}x{depth}": (ppt, depth, functools.partial(
        attention.paged_decode_attention, pages_per_tile=ppt, ring_depth=depth, sliding_window=window,
        interpret=interpret))
           for ppt in tiles for depth in depths}
    out["xla"] = (None, None, functools.partial(attention.paged_decode_attention_reference, sliding_window=window))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--pool-pages", type=int, default=4096)
    p.add_argument("--cases", default="8x256,1x256,8x2048", help="batch x context, comma separated")
    p.add_argument("--tiles", default="8,16", help="pages per KV tile, comma separated")
    p.add_argument("--depths", default="2,3", help="the tile ring's depths, comma separated")
    p.add_argument("--only", default=None, help="shape names containing this")
    p.add_argument("--interpret", action="store_true", help="off a TPU: interpret mode (checks this script)")
    args = p.parse_args()
    if not 0 <= args.pool_pages <= 1 << 20:
        p.error(f"--pool-pages must be in [0, {1 << 20}], got {args.pool_pages}")
    try:
        cases = [tuple(int(x) for x in spec.split("x")) for spec in args.cases.split(",")]
        tiles, depths = ([int(x) for x in arg.split(",")] for arg in (args.tiles, args.depths))
    except ValueError:
        p.error("--cases takes BATCHxCONTEXT,...; --tiles and --depths take integers, comma separated")
    if not all(len(c) == 2 and 1 <= c[0] <= 256 and 1 <= c[1] <= 1 << 17 for c in cases):
        p.error(f"--cases: batch in [1, 256], context in [1, {1 << 17}], got {args.cases}")
    if not all(1 <= t <= 64 for t in tiles) or not all(2 <= d <= 8 for d in depths):
        p.error(f"--tiles must be in [1, 64] and --depths in [2, 8], got {args.tiles} and {args.depths}")
    if jax.default_backend() != "tpu" and not args.interpret:
        p.error("attention_tpu.py runs on a TPU (--interpret checks it elsewhere)")
    rows = []
    for name, (h, kvh, e, window) in SHAPES.items():
        if args.only and args.only not in name:
            continue
        for batch, context in cases:
            case = make_case(h, kvh, e, batch, context, args.pool_pages)
            for variant, (ppt, depth, step) in variants(tiles, depths, window, args.interpret).items():
                row = dict(shape=name, batch=batch, context=context, pages_per_tile=ppt, ring_depth=depth,
                           variant=variant)
                try:
                    us, ms = time_variant(step, case)
                    row.update(us_per_layer=round(us, 2), call_ms=[round(m, 3) for m in ms])
                    if ppt is not None:  # the kernel's output against the reference's, on the chip
                        row["max_rel_error"] = round(max_error(step, case, window), 6)
                except Exception as err:  # a Mosaic refusal: report it, go on
                    row.update(error=str(err)[-1500:])
                print(json.dumps(row), flush=True)
                rows.append(row)
                with open(args.out, "w") as f:
                    json.dump(dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind,
                                   jax=jax.__version__, pool_pages=args.pool_pages, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
