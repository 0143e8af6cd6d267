"""The ops that make a row's result independent of its batch (docs/reliability.md, batch
invariance): the native RMSNorm (weld/kernels/cpu/norm.cc) against numpy and across row counts,
and `rounding.rounded`, which keeps XLA from fusing a product into the addition after it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.kernels import cpu as cpu_kernels
from weld.models.common import layers, quant
from weld.models.common.rounding import rounded

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the native CPU kernels (a C++ compiler)")


def numpy_rms_norm(x: np.ndarray, w: np.ndarray, eps: float, plus_one: bool) -> np.ndarray:
    x64 = x.astype(np.float64)
    scale = 1.0 + w.astype(np.float64) if plus_one else w.astype(np.float64)
    return scale * x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("d", [576, 67, 8, 3, 4096])
@pytest.mark.parametrize("plus_one", [False, True])
def test_rms_norm_matches_numpy(d, plus_one):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((37, d)) * rng.uniform(0.01, 50, (37, 1))).astype(np.float32)
    x[3] = 0.0  # a zero row: eps keeps it finite
    w = rng.standard_normal(d).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w: cpu_kernels.rms_norm(x, w, 1e-6, plus_one))(x, w))
    np.testing.assert_allclose(got, numpy_rms_norm(x, w, 1e-6, plus_one), rtol=2e-6, atol=1e-6)
    assert np.all(got[3] == 0.0)


@pytest.mark.parametrize("d", [576, 67, 1536])
def test_rms_norm_rows_do_not_depend_on_the_batch(d):
    """Bit for bit: each row alone, in any sub-batch, and inside the XLA layer that calls it (where
    XLA's own reduction gave SmolLM2's 576-wide rows an ulp of difference between 1-7 rows and 8+)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, d)).astype(np.float32) * 3
    w = rng.standard_normal(d).astype(np.float32)
    norm = jax.jit(lambda x: layers.rms_norm(x, w, 1e-5))
    full = np.asarray(norm(x))
    for m in (1, 2, 3, 5, 8, 17):
        assert np.array_equal(np.asarray(norm(x[:m])), full[:m]), m
        assert np.array_equal(np.asarray(norm(x[m:m + 1])), full[m:m + 1]), m
    as_3d = np.asarray(norm(x.reshape(4, 10, d))).reshape(40, d)  # leading axes of any shape
    assert np.array_equal(as_3d, full)


@pytest.mark.parametrize("form", ["packed", "q4_1", "int8"])
def test_matmul_rows_do_not_depend_on_the_batch(form):
    """The native matmuls, f32 panels (one row takes its own path: 4 panels at a time) and
    quantized blocks: a row's outputs are the same bits at any row count."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1537, 576)).astype(np.float32)  # a last panel of one output
    if form == "packed":
        weight = layers.pack_weight(jnp.asarray(w))
    else:
        weight = quant.quantize(w, "int8") if form == "int8" else quant.from_codes(
            *_q4_1(w), "q4_1")
    x = rng.standard_normal((15, 576)).astype(np.float32)
    linear = jax.jit(layers.linear)
    full = np.asarray(linear(x, weight))
    for m in (1, 2, 5, 6, 7, 13):
        assert np.array_equal(np.asarray(linear(x[:m], weight)), full[:m]), m
        assert np.array_equal(np.asarray(linear(x[m:m + 1], weight)), full[m:m + 1]), m


def _q4_1(w: np.ndarray):
    """Q4_1 blocks of w (codes, scales, mins) by the plain min/max rule."""
    blocks = w.reshape(w.shape[0], -1, quant.BLOCK)
    lo, hi = blocks.min(-1), blocks.max(-1)
    d = np.where(hi > lo, (hi - lo) / 15, 1.0).astype(np.float32)
    codes = np.clip(np.rint((blocks - lo[..., None]) / d[..., None]), 0, 15).astype(np.uint8)
    return codes.reshape(w.shape), d, lo.astype(np.float32)


def test_rms_norm_gradient_is_the_xla_one():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 67)).astype(np.float32)
    w = rng.standard_normal(67).astype(np.float32)
    g = rng.standard_normal((5, 67)).astype(np.float32)

    def loss(fn):
        return jax.grad(lambda x, w: jnp.sum(fn(x, w) * g), argnums=(0, 1))(x, w)

    def xla(x, w):
        return (1.0 + w) * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6))

    for ours, ref in zip(loss(lambda x, w: cpu_kernels.rms_norm(x, w, 1e-6, True)), loss(xla)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_rounded_is_the_identity_and_rounds_each_product():
    special = np.array([0.0, -0.0, 1.5, -3e-39, np.inf, -np.inf, np.nan, 3.4e38], np.float32)
    out = np.asarray(jax.jit(rounded)(special))
    assert np.array_equal(out.view(np.int32)[:6], special.view(np.int32)[:6])
    assert np.isnan(out[6]) and out[7] == special[7]
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    separate = (a * b) + c  # numpy: the product rounded, then the sum
    fused = (a.astype(np.float64) * b + c).astype(np.float32)  # one rounding (a fused multiply-add)
    assert not np.array_equal(separate, fused)  # the two differ on this data, so the check below can fail
    assert np.array_equal(np.asarray(jax.jit(lambda a, b, c: rounded(a * b) + c)(a, b, c)), separate)


def test_rounded_differentiates_as_the_identity():
    x = jnp.asarray([0.5, -2.0, 3.0], jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(rounded(x * x)))(x)
    np.testing.assert_array_equal(np.asarray(grad), 2 * np.asarray(x))
    _, tangent = jax.jvp(rounded, (x,), (jnp.ones(3, jnp.float32),))
    np.testing.assert_array_equal(np.asarray(tangent), np.ones(3))
