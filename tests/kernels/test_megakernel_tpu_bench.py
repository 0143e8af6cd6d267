"""benchmarks/megakernel_tpu.py's yardstick: the f32 reference step and each row's router margin
(how close its router came to sending it to another expert), which tells a near-tie's flip from a
wrong kernel on the chip (docs/megakernel.md, run 16)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.models.common import moe as moe_lib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import megakernel_tpu
    return megakernel_tpu


def test_router_margin_is_each_rows_smallest_gap_and_routing_is_unchanged(bench):
    cfg = bench.TINY["qwen3_moe (MoE)"]
    family = bench.family_of(cfg)
    raw = bench.device_random_weights(cfg, jnp.bfloat16)
    tokens = jnp.arange(5, dtype=jnp.int32) * 7
    route = moe_lib.route
    logits, margins = bench._f32_reference(family, cfg, raw, tokens, 5, 40, jnp.bfloat16)
    assert moe_lib.route is route  # the recording router is gone afterwards

    # the same step run eagerly with a spy in the router's place: each MoE layer's scores as numbers
    seen = []

    def spy(moe, scores, bias=None):
        seen.append(np.asarray(scores, np.float32) + (0.0 if bias is None else np.asarray(bias, np.float32)))
        return route(moe, scores, bias)
    moe_lib.route = spy
    try:
        with jax.disable_jit():
            eager, _ = bench._f32_reference(family, cfg, raw, tokens, 5, 40, jnp.bfloat16)
    finally:
        moe_lib.route = route
    assert len(seen) >= 1 and margins.shape == (5,)
    np.testing.assert_allclose(logits, eager, rtol=1e-4, atol=1e-4 * np.max(np.abs(eager)))
    k = cfg.moe.top_k
    # per layer the gap between the k-th and the (k+1)-th largest score; the row's margin: their least
    want = np.min([np.sort(s, axis=-1)[:, -k] - np.sort(s, axis=-1)[:, -k - 1] for s in seen], axis=0)
    np.testing.assert_allclose(margins, want, rtol=1e-3, atol=1e-6)
    assert np.all(margins > 0)


def test_a_dense_model_has_no_router_margin(bench):
    cfg = bench.TINY["llama (dense)"]
    raw = bench.device_random_weights(cfg, jnp.bfloat16)
    logits, margins = bench._f32_reference(bench.family_of(cfg), cfg, raw, jnp.zeros(2, jnp.int32), 2, 20,
                                           jnp.bfloat16)
    assert margins is None and logits.shape == (2, cfg.vocab_size)
