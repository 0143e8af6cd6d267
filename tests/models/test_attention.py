"""Paged attention, every form (the jnp path's all-kv-heads scores for 1-2 query rows and
grouped scores beyond, and the native CPU kernel), against a dense numpy reference: scattered
pages, padding, windows, drafter queries."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from weld.kernels import cpu as cpu_kernels
from weld.models.common import attention
from weld.utils.errors import InvalidInputError

PAGE, PAGES, H, KV, E = 4, 48, 6, 2, 8


@pytest.fixture(params=["jnp", "kernel"])
def form(request, monkeypatch):
    """Runs a test on the jnp path and on the native CPU kernel (WELD_CPU_KERNELS)."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "1" if request.param == "kernel" else "0")
    if request.param == "kernel":
        assert cpu_kernels.available(), cpu_kernels._state.get("error")  # the test machine has a compiler
    return request.param


def reference(q, k_pool, v_pool, tables, q_positions, window):
    """Softmax over each query's visible keys, read position by position through the block table."""
    b, t, H, E = q.shape
    PAGE, KV = k_pool.shape[1], k_pool.shape[2]
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


def rows(pool):
    """A pool [P, page, kv, e] (the reference's view) as the cache holds it: [P, page, kv x e]."""
    return jnp.asarray(pool).reshape(pool.shape[0], pool.shape[1], -1)


CASES = [(1, 1, None, False), (2, 1, None, False), (1, 2, 5, False), (4, 1, None, False), (3, 3, 6, False),
         (1, 2, None, True), (3, 2, None, True)]


POOL_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]  # --kv-cache-dtype


@pytest.mark.parametrize("b,t,window,drafter", CASES)
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_every_form_matches_dense_reference(b, t, window, drafter, form, pool_dtype):
    check_against_reference(b, t, window, drafter, page=PAGE, heads=H, kv_heads=KV, head_dim=E, pool_dtype=pool_dtype)


# prefill-sized chunks: several blocks of 16 queries, a window inside the chunk, padding, drafter rows;
# a verification's k + 1 queries of one row, which the kernel splits into smaller blocks (uneven ones)
LONG = [(2, 40, None, False), (1, 37, 9, False), (3, 20, None, True), (3, 33, 30, False), (1, 8, None, True),
        (1, 8, 5, False)]


@pytest.mark.parametrize("b,t,window,drafter", CASES + [(16, 1, None, False), (5, 1, 20, False)] + LONG)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 4), (40, 8, 2)])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_kernel_at_model_sizes(b, t, window, drafter, head_dim, heads, kv_heads, pool_dtype, monkeypatch):
    """The kernel's vector paths (head_dim 64, 128) and its generic path (40), 16-token pages, for
    every pool element type (the 16-bit ones widened as they are read)."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "1")
    check_against_reference(b, t, window, drafter, page=16, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            pool_dtype=pool_dtype)


# head sizes and query heads per kv head (g) that the vector paths take in pieces: the AVX-512
# path weighs the values of up to 4 (e 32, 64), 2 (96, 128) or 1 (256) heads at once
HEAD_GROUPS = [(64, 20, 4), (128, 12, 4), (256, 4, 2), (32, 8, 1), (96, 6, 2)]


@pytest.mark.parametrize("b,t,window", [(1, 1, None), (2, 40, 70), (3, 3, 6)])
@pytest.mark.parametrize("head_dim,heads,kv_heads", HEAD_GROUPS)
@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_head_groups(b, t, window, head_dim, heads, kv_heads, pool_dtype, monkeypatch):
    """Every head size the vector paths unroll, with g heads per kv head split into whole groups
    and a remainder (5 = 4 + 1, 3 = 2 + 1, 8 = 4 + 4)."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "1")
    check_against_reference(b, t, window, False, page=16, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            pool_dtype=pool_dtype)


@pytest.mark.parametrize("page", [5, 48, 128])
@pytest.mark.parametrize("b,t,window", [(1, 1, None), (1, 8, None), (2, 40, 70), (3, 3, 6)])
def test_kernel_spans_of_any_page_size(page, b, t, window, monkeypatch):
    """The kernel folds whole pages into a query's softmax a span of ~64 rows at a time: pages that
    do not divide it (5: 12 pages, 60 rows), one page short of it (48) or longer (128: one page a
    span), windows that start inside a span."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "1")
    check_against_reference(b, t, window, False, page=page, heads=9, kv_heads=3, head_dim=64)


@pytest.mark.parametrize("window", [None, 50, 9])
@pytest.mark.parametrize("e,heads,kv", [(64, 9, 3), (64, 20, 4), (128, 12, 4)])
def test_kernel_query_does_not_depend_on_its_block(window, e, heads, kv, monkeypatch):
    """A query's output is the same bits whether it comes alone (a decode step) or among 16
    (verification, a prefill chunk): the pages fold into its softmax in spans fixed by position,
    not by where the block's other queries start (with a window they start elsewhere)."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "1")
    assert cpu_kernels.available()
    rng = np.random.default_rng(11)
    pages, page, t, ctx = 40, 16, 16, 100
    k_pool = jnp.asarray(rng.standard_normal((pages, page, kv * e)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((pages, page, kv * e)), jnp.float32)
    tables = jnp.asarray(rng.permutation(pages)[None, :12].astype(np.int32))
    q = jnp.asarray(rng.standard_normal((1, t, heads, e)), jnp.float32)
    positions = np.arange(ctx, ctx + t, dtype=np.int32)[None]

    def run(q, pos):
        return cpu_kernels.paged_attention(q, k_pool, v_pool, tables, jnp.asarray(pos), scale=0.125,
                                           sliding_window=window)

    together, lse = run(q, positions)
    for j in range(t):
        alone, alone_lse = run(q[:, j:j + 1], positions[:, j:j + 1])
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], np.asarray(together)[0, j])
        np.testing.assert_array_equal(np.asarray(alone_lse)[0, 0], np.asarray(lse)[0, j])


def check_against_reference(b, t, window, drafter, *, page, heads, kv_heads, head_dim, pool_dtype=jnp.float32):
    """The pools hold pool_dtype; the reference reads the same (rounded) values in float64."""
    PAGE, H, KV, E = page, heads, kv_heads, head_dim
    PAGES = max(48, b * 12)
    rng = np.random.default_rng(b * 10 + t)
    q = rng.standard_normal((b, t, H, E)).astype(np.float32)
    k = rng.standard_normal((b, t, KV, E)).astype(np.float32)
    v = rng.standard_normal((b, t, KV, E)).astype(np.float32)
    k_pool = rng.standard_normal((PAGES, PAGE, KV, E)).astype(np.float32)
    v_pool = rng.standard_normal((PAGES, PAGE, KV, E)).astype(np.float32)
    tables = rng.permutation(PAGES)[:b * 12].reshape(b, 12).astype(np.int32)
    start = rng.integers(3, 30 * PAGE // 4, b)
    positions = (start[:, None] + np.arange(t)[None]).astype(np.int32)
    if b > 2:
        positions[1, -1] = -1  # padding writes nothing and sees nothing
    q_positions = positions
    if drafter:  # queries beyond the written context: they read it, they do not write there
        q_positions = np.where(positions >= 0, positions + 2, -1).astype(np.int32)
    as_pool = lambda a: np.asarray(jnp.asarray(a).astype(pool_dtype))  # noqa: E731
    k_pool, v_pool = as_pool(k_pool), as_pool(v_pool)
    written_k, written_v = k_pool.copy(), v_pool.copy()
    for i in range(b):
        for j in range(t):
            if positions[i, j] >= 0:
                page, row = tables[i][positions[i, j] // PAGE], positions[i, j] % PAGE
                written_k[page, row], written_v[page, row] = as_pool(k[i, j]), as_pool(v[i, j])
    want, want_lse = reference(q, written_k.astype(np.float64), written_v.astype(np.float64), tables, q_positions,
                               window)
    out, k_pages, v_pages, lse = attention.paged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), rows(k_pool), rows(v_pool),
        jnp.asarray(positions), jnp.asarray(tables), sliding_window=window, pages_per_tile=2,
        query_positions=jnp.asarray(q_positions) if drafter else None, return_lse=True)
    np.testing.assert_array_equal(np.asarray(k_pages).reshape(written_k.shape), written_k)
    np.testing.assert_array_equal(np.asarray(v_pages).reshape(written_v.shape), written_v)
    live = q_positions >= 0
    np.testing.assert_allclose(np.asarray(out)[live], want[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[live], want_lse[live], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[~live] == 0)


def _program(b, t, dtype=jnp.float32):
    import jax

    args = (jnp.zeros((b, t, H, E)), jnp.zeros((b, t, KV, E)), jnp.zeros((b, t, KV, E)),
            jnp.zeros((PAGES, PAGE, KV * E), dtype), jnp.zeros((PAGES, PAGE, KV * E), dtype),
            jnp.zeros((b, t), jnp.int32), jnp.zeros((b, 8), jnp.int32))
    # a fresh wrapper each time: JAX caches traces per function, and the kernel switch is read when traced
    return str(jax.make_jaxpr(lambda *a: attention.paged_attention(*a))(*args))


def test_the_kernel_takes_every_call_on_the_cpu(monkeypatch):
    """Decode steps and prefill chunks alike go to the kernel (pools of f32, f16 or bf16);
    WELD_CPU_KERNELS=0 turns it off and any other value is an error."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "1")
    assert "weld_paged_attention" in _program(1, 1) and "weld_paged_attention" in _program(16, 16)
    assert "weld_paged_attention" in _program(1, 300)
    assert "weld_paged_attention" in _program(4, 1, jnp.bfloat16) and "weld_paged_attention" in _program(4, 1, jnp.float16)
    monkeypatch.setenv("WELD_CPU_KERNELS", "0")
    assert "weld_paged_attention" not in _program(1, 1)
    monkeypatch.setenv("WELD_CPU_KERNELS", "yes")
    with pytest.raises(InvalidInputError, match="WELD_CPU_KERNELS must be '0' or '1', got 'yes'"):
        _program(1, 1)


def test_a_failed_build_falls_back_to_jnp(monkeypatch, tmp_path, caplog):
    """No working compiler: one warning, and the jnp path takes over with the dense reference's numbers."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "1")
    monkeypatch.setenv("WELD_KERNEL_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_kernels, "_state", {})
    with caplog.at_level("WARNING", logger="weld"):
        assert not cpu_kernels.available()
        assert not cpu_kernels.available()  # remembered: tried once
    assert [r.message for r in caplog.records if "native CPU kernels unavailable" in r.message] != []
    assert len([r for r in caplog.records if "native CPU kernels" in r.message]) == 1
    assert "weld_paged_attention" not in _program(1, 1)
    assert list(tmp_path.glob("*.so")) == []
    for b, t, window, drafter in [(1, 1, None, False), (4, 1, None, False), (3, 2, 5, True)]:  # both jnp forms
        check_against_reference(b, t, window, drafter, page=PAGE, heads=H, kv_heads=KV, head_dim=E)


def test_the_form_follows_the_row_count(monkeypatch):
    """1-2 query rows score [b, t * heads, tile * kv heads] in one dot; 3 or more rows score
    [b, kv heads, group, t, tile] per kv head (the jnp path: kernels off)."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "0")
    program = _program

    tile = 8 * PAGE  # the default pages_per_tile
    for b, t in [(1, 1), (2, 1), (1, 2)]:
        assert f"f32[{b},{t * H},{tile * KV}]" in program(b, t)
    for b, t in [(3, 1), (1, 3)]:
        text = program(b, t)
        assert f"f32[{b},{KV},{H // KV},{t},{tile}]" in text and f"f32[{b},{t * H},{tile * KV}]" not in text


@pytest.mark.parametrize("b,t", [(1, 1), (3, 20)])  # all-kv-heads rows, grouped rows (a prefill chunk)
def test_pages_wholly_before_the_window_are_never_read(b, t, form):
    """A sliding window's loop starts at the first tile some query's window reaches: NaNs in the
    tiles before it (freed pages a sliding group hands to others) leave the output finite and
    equal to the reference on the clean pool."""
    rng = np.random.default_rng(5)
    window, start = 6, 70  # queries at 70.. see 65..: tiles of 8 pages x 4 = 32 positions, tiles 0 and 1 skipped
    tables = np.arange(b * 24, dtype=np.int32).reshape(b, 24)
    q = rng.standard_normal((b, t, H, E)).astype(np.float32)
    k_pool = rng.standard_normal((b * 24, PAGE, KV, E)).astype(np.float32)
    v_pool = rng.standard_normal((b * 24, PAGE, KV, E)).astype(np.float32)
    positions = np.broadcast_to(start + np.arange(t), (b, t)).astype(np.int32)
    k_new = rng.standard_normal((b, t, KV, E)).astype(np.float32)
    v_new = rng.standard_normal((b, t, KV, E)).astype(np.float32)
    for i in range(b):
        for j in range(t):
            p = positions[i, j]
            k_pool[tables[i][p // PAGE], p % PAGE], v_pool[tables[i][p // PAGE], p % PAGE] = k_new[i, j], v_new[i, j]
    ref, _ = reference(q, k_pool, v_pool, tables, positions, window)
    poisoned_k, poisoned_v = k_pool.copy(), v_pool.copy()
    for i in range(b):
        poisoned_k[tables[i][:16]] = np.nan  # positions 0..63: before every query's window
        poisoned_v[tables[i][:16]] = np.nan
    out, _, _ = attention.paged_attention(jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                                          rows(poisoned_k), rows(poisoned_v), jnp.asarray(positions),
                                          jnp.asarray(tables), sliding_window=window)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
