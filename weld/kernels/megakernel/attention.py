"""Paged attention for the megakernel: T new tokens per row over a paged KV cache, as one Pallas
TPU call, and the tile loop (`attend_rows`) that the whole-model kernel runs inside its own call.

Covers: B rows of T query tokens each (decode: T = 1; the speculative verify block: T = k + 1
consecutive positions, causal within the block), grouped-query attention (H query heads over KV
kv heads, H % KV == 0), a paged KV cache [P, page_size, KV x E] (a row per token, its KV heads
side by side: `cache.KVPages`) shared by all rows with a block table [B, max_pages] per row,
sliding windows (a token at p sees keys in (p - window, p]; the tiles wholly before a row's
first window are neither read nor computed, so their pages may already serve others). Not
covered yet: quantized caches.

Token n = b * T + t has position p = positions[n] (p < 0: padding, output 0, nothing written;
a row is padding when its first token is). The live rows' pages stream HBM -> VMEM as one
sequence of tiles of `pages_per_tile` pages through a ring of `ring_depth` buffers, across rows
(the next rows' first tiles are in flight while this row's last computes), one DMA semaphore
per buffer. The tile that
holds a row's new tokens' page gets their K/V rows set in VMEM before it is read, and that page
is written back whole (a DMA moves whole (8, 128) tiles of a page, not one token's row),
waited for before its buffer takes the next prefetch. Per tile one product scores every query
head against every lane of the tile (each head's query on its own KV head's lanes, zero on the
others': [T x H, KV x E] x [KV x E, s]), one product weighs the values, under an online softmax;
at a row's end each head keeps its own KV head's lanes. On a TPU v5e this is 6.8x faster than
scoring each KV head's [s, E] slice of [page, KV, E] pages (SmolLM2's 9 heads over 3 of 64,
batch 8 at 256 tokens: 18 against 125 us a layer, `benchmarks/attention_tpu.py`).

Positions and block tables are scalar-prefetch operands (SMEM). A tile's pages past the row's
last are not fetched: their rows' scores are masked and their values read as 0.

`paged_block_attention_reference` is the pure-jnp twin (same contract, functional update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_MASKED = -1e30  # finite: a fully masked tile never makes exp() produce NaN
BUGS = (None, "skip_wait", "wrong_slot", "skip_write_wait", "full_window")  # planted bugs, for the tests


def paged_block_attention_reference(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                                    scale: float | None = None, sliding_window: int | None = None):
    """q [B, T, H, E]; k_new, v_new [B, T, KV, E]; pools [P, page, KV x E]; positions [B, T];
    block_tables [B, M]. Returns (out [B, T, H, E] f32, k_pages, v_pages) with every token's
    K/V written at its position."""
    b, t, h, e = q.shape
    kv_heads = k_new.shape[2]
    num_pages, page_size, _ = k_pages.shape
    g = h // kv_heads
    scale = e ** -0.5 if scale is None else scale
    safe = jnp.maximum(positions, 0)
    page = jnp.take_along_axis(block_tables, safe // page_size, axis=1)
    page = jnp.where(positions >= 0, page, num_pages).reshape(-1)  # padding: dropped
    row = (safe % page_size).reshape(-1)
    k_pages = k_pages.at[page, row].set(k_new.reshape(b * t, kv_heads * e).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, row].set(v_new.reshape(b * t, kv_heads * e).astype(v_pages.dtype), mode="drop")
    s_max = block_tables.shape[1] * page_size
    keys = k_pages[block_tables].reshape(b, s_max, kv_heads, e).astype(jnp.float32)  # [b, s, k, e]
    values = v_pages[block_tables].reshape(b, s_max, kv_heads, e).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, t, kv_heads, g, e) * scale
    s = jnp.einsum("btkge,bske->btkgs", qg, keys, precision=jax.lax.Precision.HIGHEST)
    kv_pos = jnp.arange(s_max)[None, None, None, None, :]
    visible = kv_pos <= positions[:, :, None, None, None]
    if sliding_window is not None:
        visible &= kv_pos > positions[:, :, None, None, None] - sliding_window
    s = jnp.where(visible, s, _MASKED)
    p = jnp.where(visible, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    out = jnp.einsum("btkgs,bske->btkge", p, values, precision=jax.lax.Precision.HIGHEST)
    out = out / jnp.maximum(jnp.sum(p, axis=-1), 1e-30)[..., None]
    return out.reshape(b, t, h, e), k_pages, v_pages


def paged_decode_attention_reference(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                                     scale: float | None = None, sliding_window: int | None = None):
    """The one-token twin: q [B, H, E]; k_new, v_new [B, KV, E]; positions [B]."""
    out, k_pages, v_pages = paged_block_attention_reference(q[:, None], k_new[:, None], v_new[:, None], k_pages,
                                                            v_pages, positions[:, None], block_tables, scale=scale,
                                                            sliding_window=sliding_window)
    return out[:, 0], k_pages, v_pages


def kv_scratch(pages_per_tile: int, page_size: int, width: int, dtype, rows: int, depth: int = 2) -> list:
    """The scratch `attend_rows` needs, in its argument order (k_buf, v_buf, sems, write_sems,
    live): a ring of `depth` tiles of `pages_per_tile` pages of rows `width` lanes wide (depth -
    1 tiles in flight while one computes), for `rows` rows."""
    tile = (depth, pages_per_tile * page_size, width)
    return [
        pltpu.VMEM(tile, dtype),  # K tiles [slot, tokens, KV x E]
        pltpu.VMEM(tile, dtype),  # V tiles (unused by MLA's latent pool)
        pltpu.SemaphoreType.DMA((2, depth)),  # [K or V, slot]: every page copy of a tile signals one
        pltpu.SemaphoreType.DMA((2,)),  # the pages written back (K, V)
        pltpu.SMEM((rows,), jnp.int32),  # the live rows, in order
    ]


def attend_rows(pos_ref, bt_ref, q_ref, kn_ref, vn_ref, k_pool, v_pool, out_ref, k_buf, v_buf, sems, write_sems,
                live_ref, *, rows: int, tokens: int, pages_per_tile: int, scale: float, window: int | None = None,
                table_offset: int = 0, sinks=None, kv_start=None, kv_count: int = 0, bug: str | None = None):
    """The tile loop, called inside a Pallas TPU kernel (see the module docstring).

    pos_ref [B * T] and bt_ref [B, M']: SMEM; the row's table is bt_ref[b, table_offset:] (a page
    group's, when several sit side by side). q_ref [B * T, H, E] f32, kn_ref / vn_ref [B * T, KV,
    E] (the pools' dtype) and out_ref [B * T, H, E]: VMEM. k_pool / v_pool [P, page, KV x E]:
    HBM, written in place. A row's tokens have consecutive positions. sinks: None, or f32 [1, H],
    a logit per head that joins every softmax's denominator and weighs no value (gpt-oss): the
    running max starts at it and the denominator at exp(0) = 1. kv_start (traced) and kv_count:
    the query heads read the pools' KV heads kv_start .. kv_start + kv_count - 1 only (whole
    pools replicated over tensor-parallel devices when the KV heads are fewer than they); None:
    all of them. k_buf .. live_ref: `kv_scratch(...)`. vn_ref and v_pool None: the values are the
    keys themselves (MLA's latent pool: the caller keeps the first dims).
    """
    _, page_size, width = k_pool.shape
    h, e = q_ref.shape[1], q_ref.shape[2]
    pool_heads = width // e
    kv_heads = pool_heads if kv_start is None else kv_count
    g = h // kv_heads
    hp = -(-h // 16) * 16  # the heads padded to whole sublane tiles (bf16's 16 rows)
    n = tokens * hp  # the product's rows: every token's heads
    tile_tokens = pages_per_tile * page_size
    new_pages = (tokens + page_size - 2) // page_size + 1  # the most pages a row's new tokens span
    dtype = k_pool.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    pools = ((k_pool, k_buf, kn_ref, 0),) if v_pool is None else ((k_pool, k_buf, kn_ref, 0), (v_pool, v_buf, vn_ref, 1))
    depth = k_buf.shape[0]  # the ring: depth - 1 tiles in flight while one computes

    def last_pos(row):
        last = pos_ref[row * tokens]
        for t in range(1, tokens):
            last = jnp.maximum(last, pos_ref[row * tokens + t])
        return last

    def first_tile(row):
        if window is None or bug == "full_window":  # a planted bug attends over the whole context
            return jnp.int32(0)
        return jnp.maximum(pos_ref[row * tokens] - window + 1, 0) // tile_tokens

    def page_copies(row, tile, slot, do):  # do(copy) for each page of the tile the row has (none past its last)
        first = tile * pages_per_tile
        held = jnp.clip(last_pos(row) // page_size + 1 - first, 0, pages_per_tile)

        def one(j, carry):  # a loop, not unrolled: the code stays one page's size at any tile
            page = bt_ref[row, table_offset + first + j]
            for pool, buf, _, which in pools:
                do(pltpu.make_async_copy(pool.at[page], buf.at[slot, pl.ds(pl.multiple_of(j * page_size, page_size),
                                                                           page_size)], sems.at[which, slot]))
            return carry
        jax.lax.fori_loop(0, held, one, 0)

    def write_backs(row, index, slot, tile):  # the row's page `index`, held by this tile, back to its pool
        j = pl.multiple_of((index - tile * pages_per_tile) * page_size, page_size)
        page = bt_ref[row, table_offset + index]
        return [pltpu.make_async_copy(buf.at[slot, pl.ds(j, page_size)], pool.at[page], write_sems.at[which])
                for pool, buf, _, which in pools]

    def wait_writes(pending):
        for i in range(new_pages):
            @pl.when(pending > i)
            def _():
                for w in write_backs(0, 0, 0, 0):
                    w.wait()

    def collect(row, carry):  # the live rows in order, their tiles counted; padding rows' output 0
        count, total = carry
        live = pos_ref[row * tokens] >= 0

        @pl.when(live)
        def _():
            live_ref[count] = row

        @pl.when(jnp.logical_not(live))
        def _():
            out_ref[pl.ds(row * tokens, tokens)] = jnp.zeros((tokens, h, e), out_ref.dtype)

        tiles = last_pos(row) // tile_tokens + 1 - first_tile(row)
        return count + live.astype(jnp.int32), total + jnp.where(live, tiles, 0)

    count, total = jax.lax.fori_loop(0, rows, collect, (jnp.int32(0), jnp.int32(0)))

    def live(index):  # the index-th live row (clamped: a cursor past the end reads the last one)
        return jnp.clip(live_ref[jnp.clip(index, 0, jnp.maximum(count - 1, 0))], 0, rows - 1)

    def ends(index, tile):  # is this the row's last tile?
        return tile + 1 == last_pos(live(index)) // tile_tokens + 1

    def advance(index, tile):  # the item after (the index-th live row, its tile)
        done = ends(index, tile)
        return jnp.where(done, index + 1, index), jnp.where(done, first_tile(live(index + 1)), tile + 1)

    start, wait = (lambda c: c.start()), (lambda c: c.wait())
    cursor = (jnp.int32(0), first_tile(live(0)))  # the next item to prefetch
    for slot in range(depth - 1):  # the ring's first depth - 1 items in flight
        @pl.when(cursor[0] < count)
        def _(cursor=cursor, slot=slot):
            page_copies(live(cursor[0]), cursor[1], slot, start)
        cursor = advance(*cursor)

    head = jax.lax.broadcasted_iota(jnp.int32, (tokens, hp, width), 1)
    lane_head = jax.lax.broadcasted_iota(jnp.int32, (tokens, hp, width), 2) // e
    first_head = 0 if kv_start is None else kv_start
    own_lanes = (lane_head == first_head + head // g) & (head < h)  # [t, hp, width]: each head's KV head's lanes
    token_of = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0) // hp

    def queries(row):  # [t * hp, width]: each head's scaled query on its KV head's lanes
        q = q_ref[pl.ds(row * tokens, tokens)] * scale  # [t, h, e]
        if hp > h:
            q = jnp.concatenate([q, jnp.zeros((tokens, hp - h, e), q.dtype)], axis=1)
        if pool_heads > 1:
            q = jnp.concatenate([q] * pool_heads, axis=-1)
        return jnp.where(own_lanes, q, 0.0).reshape(n, width).astype(dtype)

    def new_row(ref, index):  # [1, KV x E]: a new token's heads side by side
        x = ref[index]  # [KV, E]
        return x if pool_heads == 1 else jnp.concatenate([x[i:i + 1] for i in range(pool_heads)], axis=-1)

    def set_new_rows(row, tile, slot):  # the row's new tokens' K / V into the tile, where it holds them
        at = jax.lax.broadcasted_iota(jnp.int32, (tile_tokens, 1), 0) + tile * tile_tokens
        for _, buf, new, _ in pools:
            x = buf[slot]
            for t in range(tokens):
                p = pos_ref[row * tokens + t]
                x = jnp.where((at == p) & (p >= 0), new_row(new, row * tokens + t), x)
            buf[slot] = x

    if sinks is None:
        fresh_m, fresh_l = jnp.full((n, 1), _MASKED, jnp.float32), jnp.zeros((n, 1), jnp.float32)
    else:  # each product row's head's sink: [n, h] one-hot rows against the sinks
        pick = (jax.lax.broadcasted_iota(jnp.int32, (n, h), 0) % hp == jax.lax.broadcasted_iota(jnp.int32, (n, h), 1))
        fresh_m = jnp.sum(jnp.where(pick, sinks, 0.0), axis=-1, keepdims=True)
        fresh_m = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0) % hp < h, fresh_m, _MASKED)
        fresh_l = jnp.ones((n, 1), jnp.float32)
    fresh_acc = jnp.zeros((n, width), jnp.float32)

    def body(i, carry):
        index, tile, pf_index, pf_tile, pending, m, l, acc = carry
        slot, row = i % depth, live(index)
        last_page = last_pos(row) // page_size
        if bug != "skip_write_wait":
            wait_writes(pending)  # the last item's written-back pages, before their slot takes the prefetch

        @pl.when(pf_index < count)
        def _prefetch():
            page_copies(live(pf_index), pf_tile, (i + depth - 1) % depth, start)

        if bug != "skip_wait":
            page_copies(row, tile, slot, wait)
        first_new = pos_ref[row * tokens] // page_size  # the row's new tokens lie in pages first_new ..
        held = [(first_new + k <= last_page) & ((first_new + k) // pages_per_tile == tile) for k in range(new_pages)]
        any_held = held[0]
        for x in held[1:]:
            any_held = any_held | x
        pl.when(any_held)(lambda: set_new_rows(row, tile, slot))
        pending = jnp.int32(0)
        for k in range(new_pages):
            @pl.when(held[k])
            def _write_back(k=k):
                for w in write_backs(row, first_new + k, slot, tile):
                    w.start()
            pending = pending + held[k].astype(jnp.int32)
        read = (slot + 1) % depth if bug == "wrong_slot" else slot
        keys = k_buf[read]  # [s, width]
        values = keys if v_pool is None else v_buf[read]
        # rows past the row's last position weigh 0, but 0 * NaN is NaN: a page's stale tail (a
        # previous owner's, perhaps one ended for NaN activations; the rows of pages past the
        # last, never fetched) must read as 0
        at = tile * tile_tokens + jax.lax.broadcasted_iota(jnp.int32, (tile_tokens, 1), 0)
        values = jnp.where(at <= last_pos(row), values, jnp.zeros_like(values))
        q_pos = pos_ref[row * tokens]
        for t in range(1, tokens):
            q_pos = jnp.where(token_of == t, pos_ref[row * tokens + t], q_pos)
        kv_pos = tile * tile_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, tile_tokens), 1)
        visible = kv_pos <= q_pos  # [t * hp, s]
        if window is not None and bug != "full_window":
            visible &= kv_pos > q_pos - window
        s = jax.lax.dot_general(queries(row), keys, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        s = jnp.where(visible, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=-1, keepdims=True)
        acc = acc * correction + jax.lax.dot_general(p.astype(dtype), values, (((1,), (0,)), ((), ())),
                                                     precision=precision, preferred_element_type=jnp.float32)
        done = ends(index, tile)

        @pl.when(done)
        def _finish():  # each head keeps its own KV head's lanes
            out = (acc / jnp.maximum(l, 1e-30)).reshape(tokens, hp, width)
            if pool_heads > 1:
                out = jnp.where(own_lanes, out, 0.0)
                out = sum(out[..., k * e:(k + 1) * e] for k in range(pool_heads))
            out_ref[pl.ds(row * tokens, tokens)] = out[:, :h].astype(out_ref.dtype)

        m, l, acc = (jnp.where(done, a, b) for a, b in zip((fresh_m, fresh_l, fresh_acc), (m_new, l, acc)))
        return advance(index, tile) + advance(pf_index, pf_tile) + (pending, m, l, acc)

    init = (jnp.int32(0), first_tile(live(0))) + cursor + (jnp.int32(0), fresh_m, fresh_l, fresh_acc)
    pending = jax.lax.fori_loop(0, total, body, init)[4]
    if bug == "skip_wait":  # drain what was never waited for: every item's copies, in order
        def drain(i, item):
            page_copies(live(item[0]), item[1], i % depth, wait)
            return advance(*item)
        jax.lax.fori_loop(0, total, drain, (jnp.int32(0), first_tile(live(0))))
    wait_writes(pending)


def _validate(q, k_new, v_new, k_pages, v_pages, positions, block_tables, pages_per_tile):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, E], got shape {q.shape}")
    b, t, h, e = q.shape
    if k_pages.ndim != 3 or k_pages.shape != v_pages.shape or k_pages.shape[2] % e:
        raise ValueError(f"k_pages and v_pages must both be [P, page, KV x E] with E = {e}, got {k_pages.shape} and "
                         f"{v_pages.shape}")
    kv_heads = k_pages.shape[2] // e
    if h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kv_heads})")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if a.shape != (b, t, kv_heads, e):
            raise ValueError(f"{name} must be [B, T, KV, E] = {(b, t, kv_heads, e)}, got {a.shape}")
    if t > k_pages.shape[1]:
        raise ValueError(f"{t} tokens per row exceed a page of {k_pages.shape[1]}")
    if positions.shape != (b, t):
        raise ValueError(f"positions must be [B, T] = {(b, t)}, got {positions.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B, max_pages] with B = {b}, got {block_tables.shape}")
    if pages_per_tile <= 0:
        raise ValueError(f"pages_per_tile must be positive, got {pages_per_tile}")


def paged_block_attention(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                          scale: float | None = None, sliding_window: int | None = None, pages_per_tile: int = 8,
                          ring_depth: int = 2, interpret=False, _bug: str | None = None):
    """The Pallas kernel; same contract as `paged_block_attention_reference`.

    The pools are updated in place (aliased; donate them under jit to avoid a copy).
    `_bug` plants a DMA bug (tests only): "skip_wait" computes a KV tile without waiting for it,
    "wrong_slot" computes from the other buffer, "skip_write_wait" lets a buffer take the next
    prefetch before its written-back page has left it, "full_window" ignores the sliding window.
    """
    _validate(q, k_new, v_new, k_pages, v_pages, positions, block_tables, pages_per_tile)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if _bug not in BUGS:
        raise ValueError(f"_bug must be one of {BUGS}, got {_bug!r}")
    b, t, h, e = q.shape
    kv_heads = k_new.shape[2]
    _, page_size, width = k_pages.shape
    scale = e ** -0.5 if scale is None else scale

    def kernel(pos_ref, bt_ref,  # scalar prefetch, SMEM: positions [B * T], block tables [B, M]
               q_ref, kn_ref, vn_ref,  # VMEM: q [B * T, H, E], new K / V [B * T, KV, E]
               _k_in, _v_in,  # HBM pools, aliased to k_ref / v_ref below (use those)
               out_ref, k_ref, v_ref,  # out [B * T, H, E] VMEM; pools [P, page, KV x E] HBM
               *scratch):  # kv_scratch: K and V tiles, their semaphores, the write semaphores, the live rows
        attend_rows(pos_ref, bt_ref, q_ref, kn_ref, vn_ref, k_ref, v_ref, out_ref, *scratch, rows=b, tokens=t,
                    pages_per_tile=pages_per_tile, scale=scale, window=sliding_window, bug=_bug)

    vmem = pltpu.MemorySpace.VMEM
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        in_specs=[pl.BlockSpec(memory_space=vmem)] * 3 + [pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=[pl.BlockSpec(memory_space=vmem), pl.BlockSpec(memory_space=pl.ANY),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=kv_scratch(pages_per_tile, page_size, width, k_pages.dtype, b, ring_depth),
    )
    out, k_pages, v_pages = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((b * t, h, e), jnp.float32),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        grid_spec=grid_spec,
        # operand indices count the two scalar-prefetch operands: k_pages is 5, v_pages is 6
        input_output_aliases={5: 1, 6: 2},
        interpret=interpret,
    )(positions.reshape(-1).astype(jnp.int32), block_tables.astype(jnp.int32),
      q.reshape(b * t, h, e).astype(jnp.float32), k_new.reshape(b * t, kv_heads, e).astype(k_pages.dtype),
      v_new.reshape(b * t, kv_heads, e).astype(v_pages.dtype), k_pages, v_pages)
    return out.reshape(b, t, h, e), k_pages, v_pages


def paged_decode_attention(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                           scale: float | None = None, sliding_window: int | None = None, pages_per_tile: int = 8,
                           ring_depth: int = 2, interpret=False, _bug: str | None = None):
    """One token per row: q [B, H, E]; k_new, v_new [B, KV, E]; positions [B] (see
    `paged_block_attention`)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, E], got shape {q.shape}")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if a.ndim != 3:
            raise ValueError(f"{name} must be [B, KV, E], got shape {a.shape}")
    if positions.ndim != 1:
        raise ValueError(f"positions must be [B], got shape {positions.shape}")
    out, k_pages, v_pages = paged_block_attention(
        q[:, None], k_new[:, None], v_new[:, None], k_pages, v_pages, positions[:, None], block_tables, scale=scale,
        sliding_window=sliding_window, pages_per_tile=pages_per_tile, ring_depth=ring_depth, interpret=interpret,
        _bug=_bug)
    return out[:, 0], k_pages, v_pages
