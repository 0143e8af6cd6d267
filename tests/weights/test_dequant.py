"""Dequantization of every supported GGUF tensor type, through a real GGUF file.

Two independent checks:
- round trip: random floats quantized by gguf-py (`gguf.quants.quantize`, which has no
  K-quant quantizers) and loaded back stay within each format's worst-case error;
- reference: random valid raw blocks (all types, K-quants included) dequantize exactly as
  `ggml_reference.py`, our own per-block translation of ggml's C `dequantize_row_*`.
The real default model's Q8_0/Q4_1 tensors are checked against that reference too.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.weights import ggml_reference
from tests.weights.tiny_gguf import write_gguf
from weld.weights.gguf import SUPPORTED_TYPES, GGUFFile

Q = gguf.GGMLQuantizationType
ROWS, COLS = 4, 512  # 512: a multiple of every block size (32 and QK_K = 256)

# Worst-case |error| as a fraction of the block's max |x| (x ~ N(0, 1)), from each format's
# scale: Q8_0 d = amax/127 (error d/2); Q4_0 d = amax/8 and the opposite side clamps at 7d
# (error up to d); Q4_1 d = range/15 (d/2 <= amax/15); Q5_0 d = amax/16; Q5_1 range/31.
# F16/BF16: relative rounding 2^-11 / 2^-8 of each value. The scale d is rounded to f16 after
# the quants are chosen, which adds up to q_max * 2^-11 steps (127 * 2^-11 = 6% for Q8_0): slack 13%.
ROUND_TRIP_BOUND = {Q.Q8_0: 1 / 254, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 1 / 31}


def _blockwise_amax(x: np.ndarray, block: int) -> np.ndarray:
    return np.repeat(np.abs(x.reshape(-1, block)).max(axis=1), block).reshape(x.shape)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_round_trip(tmp_path, qtype):
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    q = gguf.quants.quantize(x, qtype)
    f = GGUFFile(write_gguf(tmp_path / "t.gguf", "llama", {}, {"t": (q, qtype) if q.dtype == np.uint8 else q}))
    assert f.type_name("t") == qtype.name
    y = f.dequantize("t")
    assert y.shape == (ROWS, COLS) and y.dtype == np.float32
    err = np.abs(y - x)
    if qtype == Q.F32:
        np.testing.assert_array_equal(y, x)
    elif qtype in (Q.F16, Q.BF16):
        rel = 2.0 ** -11 if qtype == Q.F16 else 2.0 ** -8
        assert (err <= rel * np.abs(x) + 1e-7).all()
        assert err.max() > 0  # it really was rounded
    else:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        assert (err <= 1.13 * ROUND_TRIP_BOUND[qtype] * _blockwise_amax(x, block)).all(), err.max()
        # ... and the error is typically a quarter of the step or less, not just bounded
        assert err.mean() < 0.5 * ROUND_TRIP_BOUND[qtype] * np.abs(x).max()


@pytest.mark.parametrize("kind", list(ggml_reference.BLOCKS))
def test_matches_ggml_reference(tmp_path, kind):
    qtype = Q[kind]
    block, size = ggml_reference.BLOCKS[kind]
    n_blocks = ROWS * COLS // block
    raw = ggml_reference.random_blocks(kind, n_blocks, np.random.default_rng(1))
    f = GGUFFile(write_gguf(tmp_path / "t.gguf", "llama", {}, {"t": (raw.reshape(ROWS, -1), qtype)}))
    assert f.shape("t") == (ROWS, COLS)
    expected = ggml_reference.dequantize(raw, kind).reshape(ROWS, COLS)
    np.testing.assert_allclose(f.dequantize("t"), expected, rtol=1e-6, atol=1e-7)
    assert np.abs(expected).max() > 0.01  # the blocks are not degenerate


def test_every_supported_type_is_tested():
    tested = {Q.F32, Q.F16, Q.BF16} | {Q[k] for k in ggml_reference.BLOCKS}
    assert SUPPORTED_TYPES == tested


def test_real_model_blocks_match_reference(default_gguf):
    f = GGUFFile(default_gguf)
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):  # Q8_0, Q4_1
        kind = f.type_name(name)
        raw = f.tensors[name].data[:2]  # two rows of raw blocks
        block, size = ggml_reference.BLOCKS[kind]
        expected = ggml_reference.dequantize(raw.reshape(-1, size), kind).reshape(2, -1)
        np.testing.assert_allclose(f.dequantize(name)[:2], expected, rtol=1e-6, atol=1e-7)
