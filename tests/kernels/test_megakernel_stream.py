"""The weight-stream gemv chain against its jnp twin, in Pallas TPU interpret mode."""

import numpy as np
import pytest
import jax.numpy as jnp
from interpret_mode import interpret_params, races_found

from weld.kernels.megakernel.stream import stream_chain, stream_chain_reference

# three matrices: 16 -> 24 -> 40 -> 16; with 8-row tiles the stream is 3 + 5 + 2 = 10 tiles
SHAPES = [(24, 16), (40, 24), (16, 40)]


def _problem(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    weights = [jnp.asarray((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32), dtype=dtype) for s in SHAPES]
    x = jnp.asarray(rng.standard_normal((2, SHAPES[0][1]), dtype=np.float32))
    return x, weights


@pytest.mark.parametrize("tile_rows, ring_depth", [(8, 3), (16, 2)])
def test_stream_matches_twin(interpret, tile_rows, ring_depth):
    """(8, 3): two tiles in flight, crossing each matrix boundary; (16, 2): ragged last tiles (24 = 16 + 8)."""
    x, weights = _problem()
    y = stream_chain(x, weights, tile_rows=tile_rows, ring_depth=ring_depth, interpret=interpret)
    np.testing.assert_allclose(np.asarray(y), np.asarray(stream_chain_reference(x, weights)), rtol=1e-5, atol=1e-5)
    assert not races_found()


def test_stream_bf16_weights(interpret):
    x, weights = _problem(jnp.bfloat16, seed=1)
    y = stream_chain(x, weights, tile_rows=8, ring_depth=3, interpret=interpret)
    # the kernel feeds the MXU bf16 activations (as a TPU would), the twin keeps f32
    np.testing.assert_allclose(np.asarray(y), np.asarray(stream_chain_reference(x, weights)), rtol=3e-2, atol=3e-2)


def test_stream_hand_checked():
    """One 2x2 matrix, then its transpose: [1, 2] @ W^T = [1*1+2*2, 1*3+2*4] = [5, 11]; then [5*1+11*3, 5*2+11*4]."""
    w = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    y = stream_chain(jnp.asarray([[1.0, 2.0]]), [w, w.T], tile_rows=1, ring_depth=2, interpret=interpret_params())
    np.testing.assert_array_equal(np.asarray(y), [[38.0, 54.0]])


@pytest.mark.parametrize("bug", ["skip_wait", "wrong_slot"])
def test_planted_dma_bug_is_caught(interpret, bug):
    """The harness can fail: a missing wait or a read of the wrong ring slot gives wrong output
    and a detected race under InterpretParams."""
    x, weights = _problem()
    y = np.asarray(stream_chain(x, weights, tile_rows=8, ring_depth=3, interpret=interpret, _bug=bug))
    assert not np.allclose(y, np.asarray(stream_chain_reference(x, weights)), rtol=1e-3, atol=1e-3)
    assert races_found()


def test_validation_names_both_values():
    x, weights = _problem()
    with pytest.raises(ValueError, match=r"weights\[1\] must be \[N, 24\] .* got \(40, 16\)"):
        stream_chain(x, [weights[0], jnp.zeros((40, 16))])
    with pytest.raises(ValueError, match="ring_depth must be >= 2 .* got 1"):
        stream_chain(x, weights, ring_depth=1)
    with pytest.raises(ValueError, match="_bug must be one of"):
        stream_chain(x, weights, _bug="typo")


def test_plain_interpret_hides_a_missing_wait():
    """Why the tests use InterpretParams: plain interpret=True copies at .start(), so the same
    missing-wait bug passes silently there (JAX 0.10.2)."""
    x, weights = _problem()
    y = stream_chain(x, weights, tile_rows=8, ring_depth=3, interpret=True, _bug="skip_wait")
    np.testing.assert_allclose(np.asarray(y), np.asarray(stream_chain_reference(x, weights)), rtol=1e-5, atol=1e-5)
