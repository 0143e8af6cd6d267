"""Paged attention, both score forms (all kv heads for 1-2 query rows, grouped by kv head
beyond), against a dense numpy reference: scattered pages, padding, windows, drafter queries."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from weld.models.common import attention

PAGE, PAGES, H, KV, E = 4, 48, 6, 2, 8


def reference(q, k_pool, v_pool, tables, q_positions, window):
    """Softmax over each query's visible keys, read position by position through the block table."""
    b, t = q_positions.shape
    out = np.zeros((b, t, H, E))
    lse = np.full((b, t, H), -np.inf)
    for i in range(b):
        for j in range(t):
            p = q_positions[i, j]
            if p < 0:
                continue
            seen = [s for s in range(p + 1) if window is None or s > p - window]
            keys = np.stack([k_pool[tables[i][s // PAGE], s % PAGE] for s in seen])  # [n, kv, e]
            values = np.stack([v_pool[tables[i][s // PAGE], s % PAGE] for s in seen])
            for head in range(H):
                kv = head // (H // KV)
                scores = keys[:, kv] @ q[i, j, head] / np.sqrt(E)
                w = np.exp(scores - scores.max())
                out[i, j, head] = w @ values[:, kv] / w.sum()
                lse[i, j, head] = scores.max() + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("b,t,window,drafter", [(1, 1, None, False), (2, 1, None, False), (1, 2, 5, False),
                                                (4, 1, None, False), (3, 3, 6, False), (1, 2, None, True),
                                                (3, 2, None, True)])
def test_both_forms_match_dense_reference(b, t, window, drafter):
    rng = np.random.default_rng(b * 10 + t)
    q = rng.standard_normal((b, t, H, E)).astype(np.float32)
    k = rng.standard_normal((b, t, KV, E)).astype(np.float32)
    v = rng.standard_normal((b, t, KV, E)).astype(np.float32)
    k_pool = rng.standard_normal((PAGES, PAGE, KV, E)).astype(np.float32)
    v_pool = rng.standard_normal((PAGES, PAGE, KV, E)).astype(np.float32)
    tables = rng.permutation(PAGES)[:b * 12].reshape(b, 12).astype(np.int32)
    start = rng.integers(3, 30, b)
    positions = (start[:, None] + np.arange(t)[None]).astype(np.int32)
    if b > 2:
        positions[1, -1] = -1  # padding writes nothing and sees nothing
    q_positions = positions
    if drafter:  # queries beyond the written context: they read it, they do not write there
        q_positions = np.where(positions >= 0, positions + 2, -1).astype(np.int32)
    written_k, written_v = k_pool.copy(), v_pool.copy()
    for i in range(b):
        for j in range(t):
            if positions[i, j] >= 0:
                page, row = tables[i][positions[i, j] // PAGE], positions[i, j] % PAGE
                written_k[page, row], written_v[page, row] = k[i, j], v[i, j]
    want, want_lse = reference(q, written_k, written_v, tables, q_positions, window)
    out, k_pages, v_pages, lse = attention.paged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_pool), jnp.asarray(v_pool),
        jnp.asarray(positions), jnp.asarray(tables), sliding_window=window, pages_per_tile=2,
        query_positions=jnp.asarray(q_positions) if drafter else None, return_lse=True)
    np.testing.assert_array_equal(np.asarray(k_pages), written_k)
    np.testing.assert_array_equal(np.asarray(v_pages), written_v)
    live = q_positions >= 0
    np.testing.assert_allclose(np.asarray(out)[live], want[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[live], want_lse[live], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[~live] == 0)


def test_the_form_follows_the_row_count():
    """1-2 query rows score [b, t * heads, tile * kv heads] in one dot; 3 or more rows score
    [b, kv heads, group, t, tile] per kv head."""
    import jax

    def program(b, t):
        args = (jnp.zeros((b, t, H, E)), jnp.zeros((b, t, KV, E)), jnp.zeros((b, t, KV, E)),
                jnp.zeros((PAGES, PAGE, KV, E)), jnp.zeros((PAGES, PAGE, KV, E)),
                jnp.zeros((b, t), jnp.int32), jnp.zeros((b, 8), jnp.int32))
        return str(jax.make_jaxpr(attention.paged_attention)(*args))

    tile = 8 * PAGE  # the default pages_per_tile
    for b, t in [(1, 1), (2, 1), (1, 2)]:
        assert f"f32[{b},{t * H},{tile * KV}]" in program(b, t)
    for b, t in [(3, 1), (1, 3)]:
        text = program(b, t)
        assert f"f32[{b},{KV},{H // KV},{t},{tile}]" in text and f"f32[{b},{t * H},{tile * KV}]" not in text
