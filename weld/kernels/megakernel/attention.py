"""Paged attention for the megakernel: T new tokens per row over a paged KV cache, as one Pallas
TPU call, and the tile loop (`attend_rows`) that the whole-model kernel runs inside its own call.

Covers: B rows of T query tokens each (decode: T = 1; the speculative verify block: T = k + 1
consecutive positions, causal within the block), grouped-query attention (H query heads over KV
kv heads, H % KV == 0), a paged KV cache [P, page_size, KV, E] shared by all rows with a block
table [B, max_pages] per row, sliding windows (a token at p sees keys in (p - window, p]; the
tiles wholly before a row's first window are neither read nor computed, so their pages may
already serve others). Not covered yet: quantized caches.

Token n = b * T + t has position p = positions[n] (p < 0: padding, output 0, nothing written;
a row is padding when its first token is). For each live row b:
  1. each token's new K/V [KV, E] is copied by DMA into its page, row p % page_size of page
     block_tables[b, p // page_size], in place (the pools are aliased input -> output), and
     waited for before any page is read;
  2. the row's pages 0 .. last // page_size (last = its largest position) stream HBM -> VMEM in
     tiles of `pages_per_tile` pages, double buffered (tile i+1 in flight while tile i computes),
     one DMA semaphore per buffer;
  3. an online softmax over the tiles gives out[n] = softmax(q k^T * scale, keys <= p) v (with a
     window, keys in (p - window, p]).
Positions and block tables are scalar-prefetch operands (SMEM). A tile past the row's last page
re-reads that page (its keys are masked), so no slot ever holds uninitialized memory.

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
    """q [B, T, H, E]; k_new, v_new [B, T, KV, E]; pools [P, page, KV, E]; positions [B, T];
    block_tables [B, M]. Returns (out [B, T, H, E] f32, k_pages, v_pages) with every token's
    K/V written at its position."""
    b, t, h, e = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    g = h // kv_heads
    scale = e ** -0.5 if scale is None else scale
    safe = jnp.maximum(positions, 0)
    page = jnp.take_along_axis(block_tables, safe // page_size, axis=1)
    page = jnp.where(positions >= 0, page, num_pages).reshape(-1)  # padding: dropped
    row = (safe % page_size).reshape(-1)
    k_pages = k_pages.at[page, row].set(k_new.reshape(b * t, kv_heads, e).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, row].set(v_new.reshape(b * t, kv_heads, e).astype(v_pages.dtype), mode="drop")
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


def kv_scratch(pages_per_tile: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> list:
    """The scratch `attend_rows` needs, in its argument order (k_buf, v_buf, sems, write_sems)."""
    tile = (2, pages_per_tile, page_size, kv_heads, head_dim)
    return [
        pltpu.VMEM(tile, dtype),  # K tiles, double buffered
        pltpu.VMEM(tile, dtype),  # V tiles, double buffered
        pltpu.SemaphoreType.DMA((2, 2)),  # [K or V, buffer]: every page copy of a tile signals one
        pltpu.SemaphoreType.DMA((2,)),  # the new tokens' K and V writes
    ]


def attend_rows(pos_ref, bt_ref, q_ref, kn_ref, vn_ref, k_pool, v_pool, out_ref, k_buf, v_buf, sems, write_sems,
                *, rows: int, tokens: int, pages_per_tile: int, scale: float, window: int | None = None,
                table_offset: int = 0, sinks=None, kv_start=None, kv_count: int = 0, bug: str | None = None):
    """The tile loop, called inside a Pallas TPU kernel (see the module docstring).

    pos_ref [B * T] and bt_ref [B, M']: SMEM; the row's table is bt_ref[b, table_offset:] (a page
    group's, when several sit side by side). q_ref [B * T, H, E], kn_ref / vn_ref [B * T, KV, E]
    (the pools' dtype) and out_ref [B * T, H, E]: VMEM. sinks: None, or f32 [1, H], a logit per
    head that joins every softmax's denominator and weighs no value (gpt-oss): the running max
    starts at it and the denominator at exp(0) = 1. kv_start (traced) and kv_count: the query heads
    read the pools' KV heads kv_start .. kv_start + kv_count - 1 only (whole pools replicated over
    tensor-parallel devices when the KV heads are fewer than they); None: all of them. k_pool / v_pool [P, page, KV, E]: HBM,
    written in place. k_buf, v_buf, sems, write_sems: `kv_scratch(...)`. vn_ref and v_pool None:
    the values are the keys themselves (MLA's latent pool: the caller keeps the first dims).
    """
    pools = ((k_pool, k_buf, 0),) if v_pool is None else ((k_pool, k_buf, 0), (v_pool, v_buf, 1))
    news = ((kn_ref, k_pool),) if v_pool is None else ((kn_ref, k_pool), (vn_ref, v_pool))
    _, page_size, pool_heads, e = k_pool.shape
    kv_heads = pool_heads if kv_start is None else kv_count
    h = q_ref.shape[1]
    g = h // kv_heads
    tile_tokens = pages_per_tile * page_size

    def page_copies(row, tile, slot, last_page):
        copies = []
        for j in range(pages_per_tile):
            page = bt_ref[row, table_offset + jnp.minimum(tile * pages_per_tile + j, last_page)]
            for pool, buf, which in pools:
                copies.append(pltpu.make_async_copy(pool.at[page], buf.at[slot, j], sems.at[which, slot]))
        return copies

    def token_writes(row, t):
        n, pos = row * tokens + t, pos_ref[row * tokens + t]
        page = bt_ref[row, table_offset + jnp.maximum(pos, 0) // page_size]
        return [pltpu.make_async_copy(src.at[n], pool.at[page, pos % page_size], write_sems.at[i])
                for i, (src, pool) in enumerate(news)]

    def for_live_tokens(row, fn):
        for t in range(tokens):
            @pl.when(pos_ref[row * tokens + t] >= 0)
            def _():
                for w in token_writes(row, t):
                    fn(w)

    def row_body(row, _):
        first = row * tokens

        @pl.when(pos_ref[first] < 0)
        def _padding():
            out_ref[pl.ds(first, tokens)] = jnp.zeros((tokens, h, e), out_ref.dtype)

        @pl.when(pos_ref[first] >= 0)
        def _attend():
            q_pos = [pos_ref[first + t] for t in range(tokens)]
            last = q_pos[0]
            for p in q_pos[1:]:
                last = jnp.maximum(last, p)
            last_page = last // page_size
            for_live_tokens(row, lambda w: w.start())
            if bug != "skip_write_wait":
                for_live_tokens(row, lambda w: w.wait())
            num_tiles = last // tile_tokens + 1
            # the first tile some query's window reaches (a row's tokens are consecutive, the first
            # lowest); a planted "full_window" bug attends over the whole context
            first_tile = 0
            if window is not None and bug != "full_window":
                first_tile = jnp.maximum(q_pos[0] - window + 1, 0) // tile_tokens
            for c in page_copies(row, first_tile, first_tile % 2, last_page):
                c.start()
            q = q_ref[pl.ds(first, tokens)].astype(jnp.float32)  # [t, h, e]
            qg = q.reshape(tokens, kv_heads, g, e) * scale
            q_pos_col = jnp.stack(q_pos).reshape(tokens, 1, 1, 1)  # [t, 1, 1, 1]

            def tile_body(tile, carry):
                m, l, acc = carry  # running max, denominator [t, k, g, 1]; numerator [t, k, g, e]
                slot = tile % 2

                @pl.when(tile + 1 < num_tiles)
                def _prefetch():
                    for c in page_copies(row, tile + 1, 1 - slot, last_page):
                        c.start()

                if bug != "skip_wait":
                    for c in page_copies(row, tile, slot, last_page):
                        c.wait()
                read = 1 - slot if bug == "wrong_slot" else slot
                heads = slice(None) if kv_start is None else pl.ds(kv_start, kv_count)
                keys = k_buf[read, :, :, heads].reshape(tile_tokens, kv_heads, e).astype(jnp.float32)  # [s, k, e]
                values = keys if v_pool is None else \
                    v_buf[read, :, :, heads].reshape(tile_tokens, kv_heads, e).astype(jnp.float32)
                kv_pos = tile * tile_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, 1, 1, tile_tokens), 3)
                visible = kv_pos <= q_pos_col  # [t, 1, 1, s]
                if window is not None and bug != "full_window":
                    visible &= kv_pos > q_pos_col - window
                s = jnp.einsum("tkge,ske->tkgs", qg, keys, precision=jax.lax.Precision.HIGHEST)
                s = jnp.where(visible, s, _MASKED)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
                p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
                correction = jnp.exp(m - m_new)
                l = l * correction + jnp.sum(p, axis=-1, keepdims=True)
                acc = acc * correction + jnp.einsum("tkgs,ske->tkge", p, values, precision=jax.lax.Precision.HIGHEST)
                return m_new, l, acc

            if sinks is None:
                init = (jnp.full((tokens, kv_heads, g, 1), _MASKED, jnp.float32),
                        jnp.zeros((tokens, kv_heads, g, 1), jnp.float32))
            else:
                init = (jnp.broadcast_to(sinks.reshape(1, kv_heads, g, 1), (tokens, kv_heads, g, 1)),
                        jnp.ones((tokens, kv_heads, g, 1), jnp.float32))
            init += (jnp.zeros((tokens, kv_heads, g, e), jnp.float32),)
            _, l, acc = jax.lax.fori_loop(first_tile, num_tiles, tile_body, init)
            if bug == "skip_wait":  # drain what was never waited for
                def drain(tile, _):
                    for c in page_copies(row, tile, tile % 2, last_page):
                        c.wait()
                jax.lax.fori_loop(first_tile, num_tiles, drain, None)
            if bug == "skip_write_wait":
                for_live_tokens(row, lambda w: w.wait())
            out = acc / jnp.maximum(l, 1e-30)  # a padding token inside a live row: 0
            out_ref[pl.ds(first, tokens)] = out.reshape(tokens, h, e).astype(out_ref.dtype)

        return None

    jax.lax.fori_loop(0, rows, row_body, None)


def _validate(q, k_new, v_new, k_pages, v_pages, positions, block_tables, pages_per_tile):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, E], got shape {q.shape}")
    b, t, h, e = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [P, page, KV, E], got {k_pages.shape} and {v_pages.shape}")
    _, _, kv_heads, e_cache = k_pages.shape
    if e_cache != e:
        raise ValueError(f"head dim of q ({e}) differs from the cache's ({e_cache})")
    if h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kv_heads})")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if a.shape != (b, t, kv_heads, e):
            raise ValueError(f"{name} must be [B, T, KV, E] = {(b, t, kv_heads, e)}, got {a.shape}")
    if positions.shape != (b, t):
        raise ValueError(f"positions must be [B, T] = {(b, t)}, got {positions.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B, max_pages] with B = {b}, got {block_tables.shape}")
    if pages_per_tile <= 0:
        raise ValueError(f"pages_per_tile must be positive, got {pages_per_tile}")


def paged_block_attention(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                          scale: float | None = None, sliding_window: int | None = None, pages_per_tile: int = 2,
                          interpret=False, _bug: str | None = None):
    """The Pallas kernel; same contract as `paged_block_attention_reference`.

    The pools are updated in place (aliased; donate them under jit to avoid a copy).
    `_bug` plants a DMA bug (tests only): "skip_wait" computes a KV tile without waiting for it,
    "wrong_slot" computes from the other buffer, "skip_write_wait" streams pages without first
    waiting for the new tokens' K/V to land, "full_window" ignores the sliding window.
    """
    _validate(q, k_new, v_new, k_pages, v_pages, positions, block_tables, pages_per_tile)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if _bug not in BUGS:
        raise ValueError(f"_bug must be one of {BUGS}, got {_bug!r}")
    b, t, h, e = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    scale = e ** -0.5 if scale is None else scale

    def kernel(pos_ref, bt_ref,  # scalar prefetch, SMEM: positions [B * T], block tables [B, M]
               q_ref, kn_ref, vn_ref,  # VMEM: q [B * T, H, E], new K / V [B * T, KV, E]
               _k_in, _v_in,  # HBM pools, aliased to k_ref / v_ref below (use those)
               out_ref, k_ref, v_ref,  # out [B * T, H, E] VMEM; pools [P, page, KV, E] HBM
               *scratch):  # kv_scratch: K and V tiles, their semaphores, the write semaphores
        attend_rows(pos_ref, bt_ref, q_ref, kn_ref, vn_ref, k_ref, v_ref, out_ref, *scratch, rows=b, tokens=t,
                    pages_per_tile=pages_per_tile, scale=scale, window=sliding_window, bug=_bug)

    vmem = pltpu.MemorySpace.VMEM
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        in_specs=[pl.BlockSpec(memory_space=vmem)] * 3 + [pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=[pl.BlockSpec(memory_space=vmem), pl.BlockSpec(memory_space=pl.ANY),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=kv_scratch(pages_per_tile, page_size, kv_heads, e, k_pages.dtype),
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
    )(positions.reshape(-1).astype(jnp.int32), block_tables.astype(jnp.int32), q.reshape(b * t, h, e),
      k_new.reshape(b * t, kv_heads, e).astype(k_pages.dtype), v_new.reshape(b * t, kv_heads, e).astype(v_pages.dtype),
      k_pages, v_pages)
    return out.reshape(b, t, h, e), k_pages, v_pages


def paged_decode_attention(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                           scale: float | None = None, sliding_window: int | None = None, pages_per_tile: int = 2,
                           interpret=False, _bug: str | None = None):
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
        sliding_window=sliding_window, pages_per_tile=pages_per_tile, interpret=interpret, _bug=_bug)
    return out[:, 0], k_pages, v_pages
