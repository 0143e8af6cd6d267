"""Attention over a paged KV cache, in plain jnp (the XLA path and the kernels' reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so padding rows (nothing to attend to) stay NaN-free


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
             positions: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V [b, t, k, e] into the pools [P, page, k, e] at their positions [b, t].

    Padding (position < 0) is sent out of bounds and dropped, so it never touches a page.
    """
    num_pages, page_size = k_pages.shape[:2]
    safe = jnp.maximum(positions, 0)
    page = jnp.take_along_axis(block_tables, safe // page_size, axis=1)  # [b, t]
    slot = page * page_size + safe % page_size
    slot = jnp.where(positions >= 0, slot, num_pages * page_size).reshape(-1)
    flat_shape = (num_pages * page_size,) + k_pages.shape[2:]
    k_flat = k_pages.reshape(flat_shape).at[slot].set(
        k.reshape((-1,) + k.shape[2:]).astype(k_pages.dtype), mode="drop")
    v_flat = v_pages.reshape(flat_shape).at[slot].set(
        v.reshape((-1,) + v.shape[2:]).astype(v_pages.dtype), mode="drop")
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, positions: jax.Array,
                    block_tables: jax.Array, *, sliding_window: int | None = None,
                    scale: float | None = None) -> jax.Array:
    """Causal attention of queries q [b, t, h, e] at positions [b, t] over each row's pages.

    Returns [b, t, h, e]. Row i sees the pages block_tables[i] (a window of
    max_pages * page_size positions); query at position p attends to kv positions <= p
    (and > p - sliding_window when a window is set).
    """
    b, t, h, e = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    g = h // kv_heads
    window = block_tables.shape[1] * page_size
    # Gather each row's pages in order: [b, s, k, e], s = position.
    slots = (block_tables[:, :, None] * page_size + jnp.arange(page_size)[None, None, :]).reshape(b, window)
    keys = k_pages.reshape(num_pages * page_size, kv_heads, e)[slots]
    values = v_pages.reshape(num_pages * page_size, kv_heads, e)[slots]

    if scale is None:
        scale = e ** -0.5
    qg = q.reshape(b, t, kv_heads, g, e)
    scores = jnp.einsum("btkge,bske->bkgts", qg, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    kv_pos = jnp.arange(window)[None, None, :]  # [1, 1, s]
    q_pos = positions[:, :, None]  # [b, t, 1]
    mask = kv_pos <= q_pos
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bske->btkge", probs.astype(values.dtype), values,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, e).astype(q.dtype)
