"""Attention over a paged KV cache, in plain jnp (the XLA path and the kernels' reference)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from weld.kernels import cpu as cpu_kernels
from weld.models.common import sharding

_MASKED = -1e30  # finite, so padding rows (nothing to attend to) stay NaN-free
# Up to this many query rows (batch x tokens), every query head scores every kv head's keys and
# the other heads' scores are masked: kv x the flops, but the gathered pages feed the dots as
# they lie, with no transposed copy. On the 2-core CPU box that halves batch-1 decode attention
# (8.2 -> 3.7 ms per step at ~160 tokens); from 4 rows on the grouped form is faster.
ALL_KV_HEADS_ROWS = 2
# On the CPU every call goes to the native kernel (weld/kernels/cpu/paged_attention.cc): decode,
# speculative verification, drafter blocks and prefill chunks (a 1024-token chunk of SmolLM2's
# attention: 15 ms per layer there, 85 ms in the jnp form, which scores every tile in full).


def write_pages(pages: jax.Array, x: jax.Array, positions: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Scatters new rows x [b, t, k, e] into a pool [P, page, k x e] at their positions [b, t]
    (each token's heads side by side in its row).

    Padding (position < 0) is sent out of bounds and dropped, so it never touches a page.
    """
    if positions.size == 0:  # no token to write (a reader of the pools, e.g. a drafter's block)
        return pages
    num_pages, page_size = pages.shape[:2]
    safe = jnp.maximum(positions, 0)
    page = jnp.take_along_axis(block_tables, safe // page_size, axis=1)  # [b, t]
    page = jnp.where(positions >= 0, page, num_pages).reshape(-1)  # padding: out of bounds
    row = (safe % page_size).reshape(-1)
    # Index the pool as it is: a reshape of a donated pool makes XLA:CPU copy it.
    return pages.at[page, row].set(x.reshape(page.shape[0], -1).astype(pages.dtype), mode="drop")


def write_kv(k_pages: jax.Array, v_pages: jax.Array | None, k: jax.Array, v: jax.Array | None,
             positions: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Scatters new K/V [b, t, k, e] into the pools [P, page, k x e] at their positions [b, t]
    (`write_pages` for each; v_pages None: the keys are the values, nothing more to write).
    Under data-parallel attention each rank writes its own rows into its own pages."""
    layout = _Layout.of(k.shape[2], None, positions.shape[0])
    if layout is not None and layout.rows:
        pool, rows = layout.pool, layout.row_spec
        values = None if v_pages is None else pool
        return jax.shard_map(_write_kv, mesh=layout.mesh, check_vma=False, out_specs=(pool, values),
                             in_specs=(pool, values, pool, values, rows, rows))(
            k_pages, v_pages, k, v, positions, block_tables)
    return _write_kv(k_pages, v_pages, k, v, positions, block_tables)


def _write_kv(k_pages, v_pages, k, v, positions, block_tables):
    k_pages = write_pages(k_pages, k, positions, block_tables)
    if v_pages is not None:
        v_pages = write_pages(v_pages, v, positions, block_tables)
    return k_pages, v_pages


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How paged attention splits over the active mesh: rows (and the pools' pages) over the
    data-parallel ranks, query heads over the tensor-parallel devices, the pools' KV heads with
    them when they divide (`sharding.kv_pool_axes`); with fewer KV heads each device reads the
    `kv_count` KV heads its query heads use out of whole pools."""

    mesh: Any
    rows: tuple[str, ...]  # data-parallel axes ((): rows and pages whole)
    heads: tuple[str, ...]  # the query heads' axes ((): every device computes every head)
    pool_heads: tuple[str, ...]  # the pools' KV-head axes
    kv_count: int = 0  # > 0: whole pools, each device reads kv_count KV heads from kv_start()

    @classmethod
    def of(cls, kv_heads: int, q_heads: int | None, batch: int) -> "_Layout | None":
        """The layout for pools of kv_heads and q_heads query heads (None: a write only), or None
        when there is nothing to split by hand (one device, or GSPMD's placement will do)."""
        mesh = sharding.active_mesh()
        if mesh is None:
            return None
        rows = sharding.mesh_axes(mesh, "pages")
        if rows and batch % sharding.axis_size(mesh, rows):
            raise ValueError(f"{batch} rows do not divide over {sharding.axis_size(mesh, rows)} data-parallel ranks")
        tensor = sharding.mesh_axes(mesh, "q_heads")
        n = sharding.axis_size(mesh, tensor) if tensor else 1
        pool_heads = sharding.kv_pool_axes(mesh, kv_heads)
        heads, kv_count = (), 0
        if q_heads is not None and n > 1 and q_heads % n == 0:
            local, group = q_heads // n, q_heads // kv_heads
            if pool_heads or kv_heads == 1:
                heads = tensor
            elif local % group == 0 or group % local == 0:  # a device's heads use whole KV heads of their own
                heads, kv_count = tensor, max(1, local // group)
        if not rows and not heads:
            return None
        return cls(mesh, rows, heads, pool_heads, kv_count)

    @property
    def pool(self) -> P:
        return sharding.spec_of(self.rows, None, self.pool_heads)

    @property
    def row_spec(self) -> P:
        return sharding.spec_of(self.rows, None)

    def kv_start(self, q_heads: int, kv_heads: int) -> jax.Array:
        """Inside the shard_map: this device's first KV head (of kv_count) in whole pools."""
        n = sharding.axis_size(self.mesh, self.heads)
        return jax.lax.axis_index(self.heads) * (q_heads // n) // (q_heads // kv_heads)


def _local(q, k, v, k_pages, v_pages, positions, block_tables, **kwargs):
    """`paged_attention` on a mesh, as one `shard_map` (`_Layout`): each data-parallel rank
    attends its own rows over its own pages, each tensor-parallel device with its own query
    heads over its own KV heads (or the ones they use in whole pools; MLA's single latent head
    is whole), so no page leaves its device. None when there is no mesh to split over."""
    b, _, h, _ = q.shape
    kv_heads = k.shape[2]
    layout = _Layout.of(kv_heads, h, b)
    if layout is None:
        return None
    sinks = kwargs.pop("sinks")
    query_positions = kwargs.pop("query_positions")
    return_lse = kwargs["return_lse"]
    heads = sharding.spec_of(layout.rows, None, layout.heads, None)
    pool, rows = layout.pool, layout.row_spec

    def body(q, k, v, k_pages, v_pages, positions, block_tables, query_positions, sinks):
        kv_slice = (layout.kv_start(h, kv_heads), layout.kv_count) if layout.kv_count else None
        return paged_attention(q, k, v, k_pages, v_pages, positions, block_tables, query_positions=query_positions,
                               sinks=sinks, kv_slice=kv_slice, **kwargs)

    lse = sharding.spec_of(layout.rows, None, layout.heads)
    out_specs = (heads, pool, None if v_pages is None else pool) + ((lse,) if return_lse else ())
    return jax.shard_map(body, mesh=layout.mesh, check_vma=False, out_specs=out_specs,
                         in_specs=(heads, pool, None if v is None else pool, pool, None if v_pages is None else pool,
                                   rows, rows, None if query_positions is None else rows,
                                   None if sinks is None else sharding.spec_of(layout.heads)))(
        q, k, v, k_pages, v_pages, positions, block_tables, query_positions, sinks)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array | None, k_pages: jax.Array, v_pages: jax.Array | None,
                    positions: jax.Array, block_tables: jax.Array, *, sliding_window: int | None = None,
                    scale: float | None = None, pages_per_tile: int = 8, query_positions: jax.Array | None = None,
                    return_lse: bool = False, sinks: jax.Array | None = None,
                    kv_slice: tuple[jax.Array, int] | None = None) -> tuple[jax.Array, ...]:
    """Writes this call's K/V into the pools, then attends causally over each row's pages.

    q [b, t, h, e]; k, v [b, t, kv, e]; pools [P, page, kv x e]; positions [b, t] (-1 = padding,
    which writes nothing).
    Query at position p of row i attends to that row's kv positions <= p (and
    > p - sliding_window when a window is set).
    Keys stream in tiles of `pages_per_tile` pages under an online softmax, and the loop runs
    only as far as the largest position in the batch (and, with a window, from the first tile the
    lowest query's window reaches): the program's shape does not depend on sequence lengths (no
    recompiles as they grow), and short sequences (or windows) read only a few pages.

    v_pages None (and v None): the keys are also the values (MLA's latent pages: c_kv is both
    the key's and the value's latent); the output then has the keys' width e, of which the
    caller keeps what it needs. sinks [h] (gpt-oss): a learned logit per head that joins every
    softmax's denominator and weighs no value: out *= sigmoid(lse - sink).
    query_positions [b, t] (default: positions) decouples what the queries see from where k, v
    are written (a drafter's block reads a context it does not write); return_lse adds each
    query's log-sum-exp of scores [b, t, h] (to merge with attention over other keys).
    kv_slice (start, count): the query heads read KV heads start .. start + count - 1 (a traced
    start) of pools that hold them all (one device's query heads when tensor parallelism
    exceeds the KV heads); the write still covers every head.

    Returns (out [b, t, h, e], k_pages, v_pages[, lse]). The pools ride through the loop's carry and
    the write happens inside the loop body (repeated each tile: it is idempotent and tiny).
    Every other arrangement tried (write before the loop, after it, a loop closing over the
    pools) made XLA:CPU copy each layer's whole pool on every step to keep the old one alive.
    """
    local = _local(q, k, v, k_pages, v_pages, positions, block_tables, sliding_window=sliding_window,
                         scale=scale, pages_per_tile=pages_per_tile, query_positions=query_positions,
                         return_lse=return_lse, sinks=sinks)
    if local is not None:
        return local
    b, t, h, e = q.shape
    page_size, kv_heads = k_pages.shape[1], k.shape[2]
    if kv_slice is not None:  # the query heads read kv_slice's KV heads only (the pools hold them all)
        kv_heads = kv_slice[1]
    g = h // kv_heads
    if scale is None:
        scale = e ** -0.5
    if query_positions is None:
        query_positions = positions
    pools = (k_pages,) if v_pages is None else (k_pages, v_pages)
    # The native kernel runs on one device's buffers: on a mesh, inside `_local` only.
    if (all(p.dtype in cpu_kernels.KV_DTYPES for p in pools) and cpu_kernels.available()
            and sharding.active_mesh() is None and kv_slice is None):
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, positions, block_tables)
        out, lse = cpu_kernels.paged_attention(q, k_pages, k_pages if v_pages is None else v_pages, block_tables,
                                               query_positions, scale=scale, sliding_window=sliding_window)
        return _finish(out.astype(q.dtype), k_pages, v_pages, lse, sinks, return_lse)
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % pages_per_tile)))
    tile = pages_per_tile * page_size
    num_tiles = jnp.max(query_positions) // tile + 1  # tiles holding a position some query sees
    first_tile = 0
    if sliding_window is not None:  # tiles wholly before every query's window are skipped
        lowest = jnp.min(jnp.where(query_positions >= 0, query_positions, jnp.iinfo(jnp.int32).max))
        first_tile = jnp.minimum(jnp.maximum(lowest - sliding_window + 1, 0) // tile, num_tiles)
    # Rows of queries: [b, t * h] when every head scores every kv head (few rows), else
    # [b, kv, g, t] grouped by kv head.
    all_heads = b * t <= ALL_KV_HEADS_ROWS
    if all_heads:
        qs = (q.astype(jnp.float32) * scale).reshape(b, t * h, e)
        q_pos = jnp.repeat(query_positions, h, axis=1)[:, :, None, None]  # [b, t*h, 1, 1]
        own = jnp.arange(t * h)[:, None] % h // g == jnp.arange(kv_heads)[None, :]  # [t*h, kv]
        row_shape = (b, t * h)
    else:
        qs = (q.astype(jnp.float32) * scale).reshape(b, t, kv_heads, g, e)
        q_pos = query_positions[:, None, None, :, None]  # [b, 1, 1, t, 1]
        row_shape = (b, kv_heads, g, t)

    row_last = jnp.max(query_positions, axis=1)  # [b]: the last position a query of the row sees

    def scores(i, k_pool, v_pool):
        """Masked scores of this tile, its visibility mask and the values they weigh."""
        pages = jax.lax.dynamic_slice_in_dim(block_tables, i * pages_per_tile, pages_per_tile, axis=1)
        kv_pos = i * tile + jnp.arange(tile)  # [s]
        rows = (b, pages_per_tile, page_size, k_pool.shape[2] // e, e)  # the pages' rows split into their heads
        keys = k_pool[pages].astype(jnp.float32).reshape(rows)
        values = keys if v_pool is None else v_pool[pages].astype(jnp.float32).reshape(rows)
        # Slots past every query of the row are weighed by 0, but 0 * NaN is NaN: a stale page's
        # tail (a previous owner's, perhaps one ended for NaN activations) must read as 0.
        written = (kv_pos <= row_last[:, None]).reshape(b, pages_per_tile, page_size, 1, 1)
        values = jnp.where(written, values, 0.0)
        if kv_slice is not None:  # [b, pages, page, count, e]: the tile's rows of those heads only
            keys, values = (jax.lax.dynamic_slice_in_dim(x, kv_slice[0], kv_slice[1], axis=3)
                            for x in (keys, values))
        if all_heads:  # gathered pages feed the dots as they lie: no transposed copy
            keys, values = keys.reshape(b, tile * kv_heads, e), values.reshape(b, tile * kv_heads, e)
            s = jnp.einsum("bqe,bce->bqc", qs, keys).reshape(b, t * h, tile, kv_heads)
            kv_pos = kv_pos[:, None]
            visible = (kv_pos <= q_pos) & own[None, :, None, :]
        else:
            keys, values = keys.reshape(b, tile, kv_heads, e), values.reshape(b, tile, kv_heads, e)  # [b, s, k, e]
            s = jnp.einsum("btkge,bske->bkgts", qs, keys)
            visible = kv_pos <= q_pos
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        return jnp.where(visible, s, _MASKED), visible, values

    def tile_step(i, carry):
        k_pool, v_pool, m, l, acc = carry  # running max / denominator [*rows], numerator [*rows, e]
        k_pool, v_pool = write_kv(k_pool, v_pool, k, v, positions, block_tables)
        s, visible, values = scores(i, k_pool, v_pool)
        axes = tuple(range(len(row_shape), s.ndim))
        m_new = jnp.maximum(m, jnp.max(s, axis=axes))
        p = jnp.where(visible, jnp.exp(s - m_new.reshape(m_new.shape + (1,) * len(axes))), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=axes)
        if all_heads:
            pv = jnp.einsum("bqc,bce->bqe", p.reshape(b, t * h, tile * kv_heads), values)
        else:
            pv = jnp.einsum("bkgts,bske->bkgte", p, values)
        acc = acc * correction[..., None] + pv
        return k_pool, v_pool, m_new, l, acc

    init = (k_pages, v_pages, jnp.full(row_shape, _MASKED, jnp.float32), jnp.zeros(row_shape, jnp.float32),
            jnp.zeros(row_shape + (e,), jnp.float32))
    # With no query at all (every row padding) nothing is written, as padding writes nothing.
    k_pages, v_pages, m, l, acc = jax.lax.fori_loop(first_tile, num_tiles, tile_step, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # padding rows (nothing visible) give 0
    lse = m + jnp.log(jnp.maximum(l, 1e-30))
    if not all_heads:
        out, lse = jnp.einsum("bkgte->btkge", out), jnp.einsum("bkgt->btkg", lse)
    return _finish(out.reshape(b, t, h, e).astype(q.dtype), k_pages, v_pages, lse.reshape(b, t, h), sinks,
                   return_lse)


def _finish(out, k_pages, v_pages, lse, sinks, return_lse):
    """Applies the attention sinks (out [b, t, h, e] scaled by the real keys' share of the
    denominator, sigmoid(lse - sink)) and picks the results to return."""
    if sinks is not None:
        share = jax.nn.sigmoid(lse - sinks.astype(jnp.float32))  # padding rows: lse -1e30 -> 0
        out = (out.astype(jnp.float32) * share[..., None]).astype(out.dtype)
        lse = jnp.logaddexp(lse, sinks.astype(jnp.float32))
    return (out, k_pages, v_pages, lse) if return_lse else (out, k_pages, v_pages)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *,
                    scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of q [b, t, h, e] over k, v [b, s, kv, e] (GQA) where visible [b or 1, t, s] (no
    pages: a drafter's block, training's whole sequences). Returns (out f32 [b, t, h, e],
    log-sum-exp of the visible scores [b, t, h]); a query that sees nothing gets 0 and -1e30."""
    b, t, h, e = q.shape
    kv = k.shape[2]
    if scale is None:
        scale = e ** -0.5
    qg = q.astype(jnp.float32).reshape(b, t, kv, h // kv, e) * scale
    scores = jnp.einsum("btkge,bske->btkgs", qg, k.astype(jnp.float32))
    scores = jnp.where(visible[:, :, None, None, :], scores, _MASKED)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(visible[:, :, None, None, :], jnp.exp(scores - lse[..., None]), 0.0)
    out = jnp.einsum("btkgs,bske->btkge", probs, v.astype(jnp.float32))
    return out.reshape(b, t, h, e), lse.reshape(b, t, h)
