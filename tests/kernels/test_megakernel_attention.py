"""The paged-attention decode kernel against its jnp twin and the models' XLA attention, in
Pallas TPU interpret mode (pages deliberately non-contiguous, a position crossing a page)."""

import numpy as np
import pytest
import jax.numpy as jnp
from interpret_mode import races_found

from weld.kernels.megakernel.attention import (paged_block_attention, paged_block_attention_reference,
                                               paged_decode_attention, paged_decode_attention_reference)
from weld.models.common.attention import paged_attention

B, H, KV, E, NUM_PAGES, PAGE = 3, 4, 2, 8, 16, 4
# every row's pages are scattered over the pool, out of order; row 2 is padding in most tests
BLOCK_TABLES = np.array([[7, 2, 11, 5], [3, 14, 0, 9], [12, 1, 8, 6]], np.int32)


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))
    return f(B, H, E), f(B, KV, E), f(B, KV, E), f(NUM_PAGES, PAGE, KV * E), f(NUM_PAGES, PAGE, KV * E)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_matches_twin_and_models_attention(interpret):
    """Row 0 at position 4: its first token of page 2 (written into page 2, row 0), two tiles.
    Row 1 at position 13: four pages, two tiles of two. Row 2: padding (-1)."""
    q, kn, vn, kp, vp = _problem()
    positions = jnp.asarray([4, 13, -1], jnp.int32)
    bt = jnp.asarray(BLOCK_TABLES)
    ref_out, ref_k, ref_v = paged_decode_attention_reference(q, kn, vn, kp, vp, positions, bt)
    out, k2, v2 = paged_decode_attention(q, kn, vn, kp, vp, positions, bt, pages_per_tile=2, interpret=interpret)
    assert not races_found()
    _close(out, ref_out)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(ref_v))
    np.testing.assert_array_equal(np.asarray(k2)[2, 0], np.asarray(kn)[0].reshape(-1))  # row 0's token: its page 1 = pool page 2, slot 0
    np.testing.assert_array_equal(np.asarray(out)[2], 0.0)  # padding
    # the models' XLA path (one query token per row) agrees on the live rows and the pools
    xla_out, xla_k, xla_v = paged_attention(q[:, None], kn[:, None], vn[:, None], kp, vp, positions[:, None], bt,
                                            pages_per_tile=2)
    _close(out[:2], xla_out[:2, 0])
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(xla_k))


def test_decode_steps_cross_a_page_boundary(interpret):
    """Two steps of one row, positions 3 -> 4, pools carried through the in-place kernel: the
    first fills the last slot of pool page 3, the second opens pool page 14 and sees all five tokens."""
    q, kn, vn, kp, vp = _problem(seed=1)
    bt = jnp.asarray(BLOCK_TABLES[1:2])
    ref_k, ref_v, k, v = kp, vp, kp, vp
    for step, pos in enumerate([3, 4]):
        positions = jnp.asarray([pos], jnp.int32)
        qs, kns, vns = q[:1] + step, kn[:1] * (step + 1), vn[:1] - step
        ref_out, ref_k, ref_v = paged_decode_attention_reference(qs, kns, vns, ref_k, ref_v, positions, bt)
        out, k, v = paged_decode_attention(qs, kns, vns, k, v, positions, bt, pages_per_tile=1, interpret=interpret)
        _close(out, ref_out)
        np.testing.assert_array_equal(np.asarray(k), np.asarray(ref_k))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(ref_v))
    assert not races_found()


@pytest.mark.parametrize("bug", [None, "full_window"])
def test_sliding_window_skips_the_tiles_before_it(interpret, bug):
    """Window 5: row 0 at position 13 sees 9..13 (its tile 0, pages 7 and 2, is wholly before the
    window: poisoned with NaN, never read), row 1 at 6 sees 2..6 (its window starts inside tile 0),
    row 2 is padding. The twin, the models' XLA attention and the kernel agree; a kernel that
    ignores the window ("full_window") reads the poison."""
    q, kn, vn, kp, vp = _problem(seed=3)
    positions = jnp.asarray([13, 6, -1], jnp.int32)
    bt = jnp.asarray(BLOCK_TABLES)
    ref_out, ref_k, _ = paged_decode_attention_reference(q, kn, vn, kp, vp, positions, bt, sliding_window=5)
    full_out, _, _ = paged_decode_attention_reference(q, kn, vn, kp, vp, positions, bt)
    assert not np.allclose(np.asarray(ref_out[:2]), np.asarray(full_out[:2]), atol=1e-3)  # the window matters
    xla_out, _, _ = paged_attention(q[:, None], kn[:, None], vn[:, None], kp, vp, positions[:, None], bt,
                                    pages_per_tile=2, sliding_window=5)
    _close(ref_out[:2], xla_out[:2, 0])
    poisoned = [p.at[jnp.asarray([7, 2])].set(jnp.nan) for p in (kp, vp)]
    out, k2, _ = paged_decode_attention(q, kn, vn, *poisoned, positions, bt, sliding_window=5, pages_per_tile=2,
                                        interpret=interpret, _bug=bug)
    if bug is None:
        assert not races_found()
        _close(out, ref_out)
        np.testing.assert_array_equal(np.asarray(k2)[np.asarray([11, 5, 3, 14, 0, 9])],
                                      np.asarray(ref_k)[np.asarray([11, 5, 3, 14, 0, 9])])
    else:
        assert not np.all(np.isfinite(np.asarray(out[0])))


def test_a_stale_page_tail_reads_as_zero(interpret):
    """NaN in the rows past a row's position (a page's previous owner's) weighs nothing: the
    output equals the reference's on the clean pools (0 x NaN would be NaN)."""
    q, kn, vn, kp, vp = _problem(seed=4)
    positions = jnp.asarray([4, 13, -1], jnp.int32)
    bt = jnp.asarray(BLOCK_TABLES)
    ref_out, _, _ = paged_decode_attention_reference(q, kn, vn, kp, vp, positions, bt)
    # row 0's page 1 (pool page 2) past position 4 (its row 0), row 1's page 3 (pool page 9) past 13 (row 1)
    stale = [p.at[2, 1:].set(jnp.nan).at[9, 2:].set(jnp.nan) for p in (kp, vp)]
    out, _, _ = paged_decode_attention(q, kn, vn, *stale, positions, bt, pages_per_tile=2, interpret=interpret)
    assert np.all(np.isfinite(np.asarray(out)))
    _close(out, ref_out)


@pytest.mark.parametrize("ring_depth", [2, 3, 4])
def test_a_verify_block_across_pages_tiles_and_rows(interpret, ring_depth):
    """Blocks of 3 tokens (a verify step): row 0 at 3..5 writes the last row of its page 0 and
    the first two of page 1, in two tiles of one page; row 1 at 13..15 fills its page 3's tail;
    row 2's last token is padding (written nowhere). Every ring depth streams the rows' tiles
    as one sequence and agrees with the twin, pools included."""
    rng = np.random.default_rng(7)
    f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    q, kn, vn = f(B, 3, H, E), f(B, 3, KV, E), f(B, 3, KV, E)
    kp, vp = f(NUM_PAGES, PAGE, KV * E), f(NUM_PAGES, PAGE, KV * E)
    positions = jnp.asarray([[3, 4, 5], [13, 14, 15], [6, 7, -1]], jnp.int32)
    bt = jnp.asarray(BLOCK_TABLES)
    ref_out, ref_k, ref_v = paged_block_attention_reference(q, kn, vn, kp, vp, positions, bt)
    out, k2, v2 = paged_block_attention(q, kn, vn, kp, vp, positions, bt, pages_per_tile=1, ring_depth=ring_depth,
                                        interpret=interpret)
    assert not races_found()
    _close(out[:2], ref_out[:2])
    _close(out[2, :2], ref_out[2, :2])
    np.testing.assert_array_equal(np.asarray(out)[2, 2], 0.0)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(ref_v))


def test_hand_checked_single_token():
    """Position 0: the only visible key is the new token's, so the output is its value exactly."""
    from interpret_mode import interpret_params

    q, kn, vn, kp, vp = _problem(seed=2)
    out, _, _ = paged_decode_attention(q[:1], kn[:1], vn[:1], kp, vp, jnp.asarray([0], jnp.int32),
                                       jnp.asarray(BLOCK_TABLES[:1]), interpret=interpret_params())
    expected = np.repeat(np.asarray(vn[0]), H // KV, axis=0)  # heads 0,1 read kv head 0; heads 2,3 kv head 1
    np.testing.assert_allclose(np.asarray(out[0]), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bug", ["skip_wait", "wrong_slot", "skip_write_wait"])
def test_planted_dma_bug_is_caught(interpret, bug):
    """A missing wait on a KV tile or a read of the other buffer gives wrong output (NaN or a
    stale key); a buffer that takes the next prefetch before its written-back page has left it
    writes the wrong page into the pool (or races). Interpret mode only: on a chip a race may go
    either way, and no detector watches."""
    if not interpret:
        pytest.skip("a planted race is caught by interpret mode's NaN scratch and race detector, not on a chip")
    q, kn, vn, kp, vp = _problem()
    positions = jnp.asarray([4, 13, -1], jnp.int32)
    bt = jnp.asarray(BLOCK_TABLES)
    ref_out, ref_k, ref_v = paged_decode_attention_reference(q, kn, vn, kp, vp, positions, bt)
    out, k2, v2 = paged_decode_attention(q, kn, vn, kp, vp, positions, bt, pages_per_tile=2, interpret=interpret,
                                         _bug=bug)
    if bug == "skip_write_wait":  # the output is right; the pages written back are not
        assert not (np.array_equal(np.asarray(k2), np.asarray(ref_k)) and np.array_equal(np.asarray(v2), np.asarray(ref_v)))
        return
    wrong = not np.allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-3, atol=1e-3)
    assert wrong  # visible in the numbers, not only to the race detector


def test_validation_names_both_values():
    q, kn, vn, kp, vp = _problem()
    positions, bt = jnp.zeros((B,), jnp.int32), jnp.asarray(BLOCK_TABLES)
    with pytest.raises(ValueError, match=r"k_new must be \[B, T, KV, E\] = \(3, 1, 2, 8\), got \(3, 1, 4, 8\)"):
        paged_decode_attention(q, jnp.zeros((B, H, E)), vn, kp, vp, positions, bt)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of kv heads \(3\)"):
        paged_decode_attention(q, kn, vn, jnp.zeros((4, PAGE, 3 * E)), jnp.zeros((4, PAGE, 3 * E)), positions, bt)
    with pytest.raises(ValueError, match=r"must both be \[P, page, KV x E\] with E = 8, got \(4, 4, 2, 8\)"):
        paged_decode_attention(q, kn, vn, jnp.zeros((4, PAGE, KV, E)), jnp.zeros((4, PAGE, KV, E)), positions, bt)
    with pytest.raises(ValueError, match=r"positions must be \[B, T\] = \(3, 1\), got \(2, 1\)"):
        paged_decode_attention(q, kn, vn, kp, vp, positions[:2], bt)
