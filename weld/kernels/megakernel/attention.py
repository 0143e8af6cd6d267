"""Paged-attention decode: the megakernel's attention tile loop, as one Pallas TPU call.

Covers: one new token per row (decode), B rows, grouped-query attention (H query heads over
KV kv heads, H % KV == 0), a paged KV cache [P, page_size, KV, E] shared by all rows with a
block table [B, max_pages] per row. Not covered yet: sliding windows, several query tokens per
row (the verify block), quantized caches.

For each row b with position p = positions[b] (p < 0: padding, output 0, nothing written):
  1. the new token's K/V [KV, E] is copied by DMA into its page, row p % page_size of page
     block_tables[b, p // page_size], in place: the pools are aliased input -> output;
  2. the row's pages 0 .. p // page_size stream HBM -> VMEM in tiles of `pages_per_tile` pages,
     double buffered (tile t+1 in flight while tile t computes), one DMA semaphore per buffer;
  3. an online softmax over the tiles gives out[b] = softmax(q k^T * scale, keys <= p) v.
Positions and block tables are scalar-prefetch operands (SMEM). A tile past the row's last page
re-reads that page (its keys are masked), so no slot ever holds uninitialized memory.

`paged_decode_attention_reference` is the pure-jnp twin (same contract, functional update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_MASKED = -1e30  # finite: a fully masked tile never makes exp() produce NaN
_BUGS = (None, "skip_wait", "wrong_slot", "skip_write_wait")


def paged_decode_attention_reference(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                                     scale: float | None = None):
    """q [B, H, E]; k_new, v_new [B, KV, E]; pools [P, page, KV, E]; positions [B]; block_tables [B, M].

    Returns (out [B, H, E] f32, k_pages, v_pages) with the new K/V written at each row's position.
    """
    b, h, e = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    g = h // kv_heads
    scale = e ** -0.5 if scale is None else scale
    safe = jnp.maximum(positions, 0)
    page = jnp.where(positions >= 0, block_tables[jnp.arange(b), safe // page_size], num_pages)  # padding: dropped
    row = safe % page_size
    k_pages = k_pages.at[page, row].set(k_new.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, row].set(v_new.astype(v_pages.dtype), mode="drop")
    s_max = block_tables.shape[1] * page_size
    keys = k_pages[block_tables].reshape(b, s_max, kv_heads, e).astype(jnp.float32)  # [b, s, k, e]
    values = v_pages[block_tables].reshape(b, s_max, kv_heads, e).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, kv_heads, g, e) * scale
    s = jnp.einsum("bkge,bske->bkgs", qg, keys, precision=jax.lax.Precision.HIGHEST)
    visible = jnp.arange(s_max)[None, None, None, :] <= positions[:, None, None, None]
    s = jnp.where(visible, s, _MASKED)
    p = jnp.where(visible, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    out = jnp.einsum("bkgs,bske->bkge", p, values, precision=jax.lax.Precision.HIGHEST)
    out = out / jnp.maximum(jnp.sum(p, axis=-1), 1e-30)[..., None]
    return out.reshape(b, h, e), k_pages, v_pages


def _validate(q, k_new, v_new, k_pages, v_pages, positions, block_tables, pages_per_tile):
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, E], got shape {q.shape}")
    b, h, e = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [P, page, KV, E], got {k_pages.shape} and {v_pages.shape}")
    _, _, kv_heads, e_cache = k_pages.shape
    if e_cache != e:
        raise ValueError(f"head dim of q ({e}) differs from the cache's ({e_cache})")
    if h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kv_heads})")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if a.shape != (b, kv_heads, e):
            raise ValueError(f"{name} must be [B, KV, E] = {(b, kv_heads, e)}, got {a.shape}")
    if positions.shape != (b,):
        raise ValueError(f"positions must be [B] = ({b},), got {positions.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B, max_pages] with B = {b}, got {block_tables.shape}")
    if pages_per_tile <= 0:
        raise ValueError(f"pages_per_tile must be positive, got {pages_per_tile}")


def paged_decode_attention(q, k_new, v_new, k_pages, v_pages, positions, block_tables, *,
                           scale: float | None = None, pages_per_tile: int = 2, interpret=False,
                           _bug: str | None = None):
    """The Pallas kernel; same contract as `paged_decode_attention_reference`.

    The pools are updated in place (aliased; donate them under jit to avoid a copy).
    `_bug` plants a DMA bug (tests only): "skip_wait" computes a KV tile without waiting for it,
    "wrong_slot" computes from the other buffer, "skip_write_wait" streams pages without first
    waiting for the new token's K/V to land.
    """
    _validate(q, k_new, v_new, k_pages, v_pages, positions, block_tables, pages_per_tile)
    if _bug not in _BUGS:
        raise ValueError(f"_bug must be one of {_BUGS}, got {_bug!r}")
    b, h, e = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    g = h // kv_heads
    scale = e ** -0.5 if scale is None else scale
    tile_tokens = pages_per_tile * page_size

    def kernel(pos_ref, bt_ref,  # scalar prefetch, SMEM: positions [B], block tables [B, M]
               q_ref, kn_ref, vn_ref,  # VMEM: q [B, H, E], new K / V [B, KV, E]
               _k_in, _v_in,  # HBM pools, aliased to k_ref / v_ref below (use those)
               out_ref, k_ref, v_ref,  # out [B, H, E] VMEM; pools [P, page, KV, E] HBM
               k_buf, v_buf, sems, write_sems):  # see scratch_shapes

        def page_copies(row, tile, slot, last_page):
            copies = []
            for j in range(pages_per_tile):
                page = bt_ref[row, jnp.minimum(tile * pages_per_tile + j, last_page)]
                for pool, buf, which in ((k_ref, k_buf, 0), (v_ref, v_buf, 1)):
                    copies.append(pltpu.make_async_copy(pool.at[page], buf.at[slot, j], sems.at[which, slot]))
            return copies

        def row_body(row, _):
            pos = pos_ref[row]

            @pl.when(pos < 0)
            def _padding():
                out_ref[row] = jnp.zeros((h, e), out_ref.dtype)

            @pl.when(pos >= 0)
            def _attend():
                last_page = pos // page_size
                write_page = bt_ref[row, last_page]
                writes = [pltpu.make_async_copy(src.at[row], pool.at[write_page, pos % page_size], write_sems.at[i])
                          for i, (src, pool) in enumerate(((kn_ref, k_ref), (vn_ref, v_ref)))]
                for w in writes:
                    w.start()
                if _bug != "skip_write_wait":
                    for w in writes:
                        w.wait()
                num_tiles = pos // tile_tokens + 1
                for c in page_copies(row, 0, 0, last_page):
                    c.start()
                qg = q_ref[row].astype(jnp.float32).reshape(kv_heads, g, e) * scale  # [k, g, e]

                def tile_body(tile, carry):
                    m, l, acc = carry  # running max, denominator [k, g, 1]; numerator [k, g, e]
                    slot = tile % 2

                    @pl.when(tile + 1 < num_tiles)
                    def _prefetch():
                        for c in page_copies(row, tile + 1, 1 - slot, last_page):
                            c.start()

                    if _bug != "skip_wait":
                        for c in page_copies(row, tile, slot, last_page):
                            c.wait()
                    read = 1 - slot if _bug == "wrong_slot" else slot
                    keys = k_buf[read].reshape(tile_tokens, kv_heads, e).astype(jnp.float32)  # [s, k, e]
                    values = v_buf[read].reshape(tile_tokens, kv_heads, e).astype(jnp.float32)
                    kv_pos = tile * tile_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, 1, tile_tokens), 2)
                    visible = kv_pos <= pos  # [1, 1, s]
                    s = jnp.einsum("kge,ske->kgs", qg, keys, precision=jax.lax.Precision.HIGHEST)
                    s = jnp.where(visible, s, _MASKED)
                    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
                    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
                    correction = jnp.exp(m - m_new)
                    l = l * correction + jnp.sum(p, axis=-1, keepdims=True)
                    acc = acc * correction + jnp.einsum("kgs,ske->kge", p, values,
                                                        precision=jax.lax.Precision.HIGHEST)
                    return m_new, l, acc

                init = (jnp.full((kv_heads, g, 1), _MASKED, jnp.float32), jnp.zeros((kv_heads, g, 1), jnp.float32),
                        jnp.zeros((kv_heads, g, e), jnp.float32))
                _, l, acc = jax.lax.fori_loop(0, num_tiles, tile_body, init)
                if _bug == "skip_wait":  # drain what was never waited for
                    def drain(tile, _):
                        for c in page_copies(row, tile, tile % 2, last_page):
                            c.wait()
                    jax.lax.fori_loop(0, num_tiles, drain, None)
                if _bug == "skip_write_wait":
                    for w in writes:
                        w.wait()
                out_ref[row] = (acc / l).reshape(h, e).astype(out_ref.dtype)

            return None

        jax.lax.fori_loop(0, b, row_body, None)

    vmem = pltpu.MemorySpace.VMEM
    page_shape = (pages_per_tile, page_size, kv_heads, e)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        in_specs=[pl.BlockSpec(memory_space=vmem)] * 3 + [pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=[pl.BlockSpec(memory_space=vmem), pl.BlockSpec(memory_space=pl.ANY),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[
            pltpu.VMEM((2,) + page_shape, k_pages.dtype),  # K tiles, double buffered
            pltpu.VMEM((2,) + page_shape, v_pages.dtype),  # V tiles, double buffered
            pltpu.SemaphoreType.DMA((2, 2)),  # [K or V, buffer]: every page copy of a tile signals one
            pltpu.SemaphoreType.DMA((2,)),  # the new token's K and V writes
        ],
    )
    out, k_pages, v_pages = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((b, h, e), jnp.float32),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        grid_spec=grid_spec,
        # operand indices count the two scalar-prefetch operands: k_pages is 5, v_pages is 6
        input_output_aliases={5: 1, 6: 2},
        interpret=interpret,
    )(positions.astype(jnp.int32), block_tables.astype(jnp.int32), q, k_new.astype(k_pages.dtype),
      v_new.astype(v_pages.dtype), k_pages, v_pages)
    return out, k_pages, v_pages
