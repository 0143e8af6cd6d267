"""The greedy choice's native kernel (weld/kernels/cpu/argmax.cc, through `weld.engine.sampler.argmax`
and `all_finite`) against jnp.argmax and jnp.isfinite: ties (the first wins), NaN (the first NaN
wins, as in jnp.argmax), +-inf, rows of -inf, signed zeros, widths that are not a multiple of the
8 lanes, leading axes, and the programs that ask for both of one input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.engine import sampler
from weld.kernels import cpu


def cases(v: int) -> np.ndarray:
    rng = np.random.default_rng(v)
    rows = [rng.standard_normal(v)]
    tie = rng.standard_normal(v)
    tie[[v // 3, v - 1]] = 50.0  # two maxima: the first is the argmax
    rows.append(tie)
    late = np.full(v, -3.0)
    late[-1] = 2.0  # the maximum in the scalar tail
    rows.append(late)
    nans = rng.standard_normal(v)
    nans[[v // 2, v - 1]] = np.nan
    nans[0] = 1e30
    rows.append(nans)  # the first NaN, not the larger value before it
    infs = rng.standard_normal(v)
    infs[v - 1] = np.inf
    rows.append(infs)
    rows.append(np.full(v, -np.inf))
    zeros = np.zeros(v)
    zeros[: v // 2] = -0.0
    rows.append(zeros)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("v", [1, 7, 8, 9, 63, 1000, 49152 + 5])
def test_native_argmax_and_finite_equal_jnp(v):
    assert cpu.available(), cpu._state.get("error")
    x = jnp.asarray(cases(v))
    index, finite = jax.jit(lambda x: (sampler.argmax(x), sampler.all_finite(x)))(x)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(np.asarray(finite), np.asarray(jnp.all(jnp.isfinite(x), axis=-1)))
    assert index.dtype == jnp.int32 and finite.dtype == jnp.bool_


def test_leading_axes_and_the_jnp_path(monkeypatch):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 77)).astype(np.float32))
    native = jax.jit(sampler.argmax)(x)
    assert native.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(native), np.asarray(jnp.argmax(x, axis=-1)))
    text = str(jax.make_jaxpr(sampler.argmax)(x))
    assert "weld_argmax" in text
    monkeypatch.setenv("WELD_CPU_KERNELS", "0")
    text = str(jax.make_jaxpr(lambda x: sampler.argmax(x))(x))
    assert "weld_argmax" not in text and "argmax" in text
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: sampler.argmax(x))(x)), np.asarray(native))


def test_a_program_taking_both_reads_the_logits_once():
    x = jnp.zeros((4, 64), jnp.float32)
    hlo = jax.jit(lambda x: (sampler.argmax(x), sampler.all_finite(x))).lower(x).compile().as_text()
    assert hlo.count('custom_call_target="weld_argmax"') == 1
