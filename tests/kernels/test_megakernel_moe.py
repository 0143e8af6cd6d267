"""Mixture-of-experts layers and hidden states in the decode megakernel, against the XLA path
(`weld.models.llama.forward`, whose MoE block is `weld.models.common.moe.moe_block`), in Pallas
TPU interpret mode: sparse and dense layers in one weight stream, each routed pair's expert
fetched by DMA after the in-kernel router, a shared expert with its sigmoid gate, group-limited
routing with a correction bias, int8 expert stacks, a planted wrong-expert bug, and the
residual streams a drafter reads."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from interpret_mode import races_found
from test_megakernel_decode import (LLAMA, OPTIONS, PAGE, WINDOW_OPTIONS, _assert_caches_close, _dequantized,
                                    _greedy_run, _int8_matches_xla, _kernel_step, _quantized, _rel_err, _setup,
                                    _xla_step)

from weld.kernels.megakernel import decode as mk
from weld.kernels.megakernel import plan as mkplan
from weld.models import gpt_oss, llama
from weld.models import megakernel
from weld.models.common import moe as moe_lib
from weld.models.common import quant
from weld.models.common.rope import Rope, RopeScaling

# Qwen3-MoE's shape: softmax top-2 of 6 experts, renormalised; layers 0 and 2 sparse, layer 1 dense;
# the expert stacks' gate / up [6, 128, 32] stream from their transposes (`plan.stored_transposed`)
QWEN_MOE = llama.Config(architecture="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, rope_theta=1e6,
                        moe=moe_lib.MoE(num_experts=6, top_k=2, intermediate_size=128, router="softmax_topk",
                                        norm_topk_prob=True),
                        sparse_layers=(0, 2))
# DeepSeek-V3 / Kimi routing (sigmoid scores, a correction bias for selection, the best 2 of 4
# groups, scaled weights) with Qwen3-Next's gated shared expert, every layer sparse
GROUPED = dataclasses.replace(
    LLAMA, architecture="qwen3_moe", vocab_size=64, intermediate_size=40, sparse_layers=(0, 1),
    moe=moe_lib.MoE(num_experts=8, top_k=3, intermediate_size=16, router="sigmoid_group", n_group=4, topk_group=2,
                    score_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5, shared_intermediate_size=24,
                    shared_gate=True))


# gpt-oss: attention sinks, q/k/v/o biases, a sliding layer (window 3) and a full one, YaRN without
# truncation, a router bias, top-2-then-softmax routing, experts with biases and the clamped
# SwiGLU (a small limit, so the clamps bite on random weights)
GPT_OSS = gpt_oss.Config(
    architecture="gpt_oss", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    moe=moe_lib.MoE(num_experts=4, top_k=2, intermediate_size=16, router="topk_softmax", activation="clamped_swiglu",
                    expert_bias=True, router_bias=True, swiglu_limit=0.3, swiglu_alpha=1.702),
    layer_types=(gpt_oss.SLIDING, gpt_oss.FULL), sliding_window=3,
    rope=Rope(8, 1.5e5, RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16, truncate=False), 64))


def _random_biases(weights, rng):
    """Sinks, attention biases, the router's and the experts' biases away from their zero init."""
    for lw in weights["layers"]:
        for tree in (lw, lw.get("moe", {})):
            for name in [n for n in tree if n.startswith("b") or n in ("sinks", "router_bias")]:
                tree[name] = jnp.asarray(rng.normal(0.0, 0.5, tree[name].shape), jnp.float32)


def test_gpt_oss_sinks_and_biased_clamped_experts_match_xla(interpret):
    """Batch 4 with a padding row, 5 greedy steps past the sliding layer's skipped tiles."""
    errors, cache, ref_cache = _greedy_run(GPT_OSS, batch=4, steps=5, interpret=interpret, padding_row=True,
                                           options=WINDOW_OPTIONS, adjust=_random_biases)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


def _with_score_bias(weights, cfg, seed=7):
    """A correction bias that changes which experts win (the random init is zeros)."""
    rng = np.random.default_rng(seed)
    for i in cfg.sparse_layers:
        weights["layers"][i]["moe"]["score_bias"] = jnp.asarray(rng.normal(0, 0.3, cfg.moe.num_experts), jnp.float32)
    return weights


def test_schedule_streams_each_pairs_expert_after_the_static_tiles():
    spec = megakernel.spec_for(QWEN_MOE, batch=2, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    tiles = mkplan.stream_schedule(spec, tile_rows=16, vocab_tile_rows=32)
    layer0 = [t.key for t in tiles if t.layer == 0]
    # attention, then 2 tokens x top-2 = 4 pairs, each gate (128 rows: 8 tiles), up (8), down (32 rows: 2 tiles)
    assert layer0[:6] == [(0, "q", -1), (0, "q", -1), (0, "k", -1), (0, "v", -1), (0, "o", -1), (0, "o", -1)]
    assert layer0[6:] == [(0, name, pair) for pair in range(4) for name in ("gate",) * 8 + ("up",) * 8 + ("down",) * 2]
    # gate / up [6, 128, 32] lie column-major on a TPU: streamed from their transposes, down not
    assert {t.matrix for t in tiles if t.transposed and t.layer == 0} == {"gate", "up"}
    assert [t.matrix for t in tiles if t.layer == 1][-3:] == ["up", "down", "down"]  # the dense layer as before
    assert all(t.pair == -1 for t in tiles if t.layer == 1)
    # bytes: the static matrices, 4 experts' worth of each sparse layer, the routers read whole
    expert = (128 * 32) * 3 * 4
    assert spec.layer_weight_bytes(0) == (32 * 32 + 2 * 16 * 32 + 32 * 32) * 4 + 4 * expert
    assert sum(t.nbytes for t in tiles if t.layer == 0) == spec.layer_weight_bytes(0)
    assert spec.router_bytes() == 6 * 32 * 4


def test_moe_batch4_with_padding_matches_xla(interpret):
    """Two sparse layers around a dense one, batch 4 with a padding row, 3 greedy steps."""
    errors, cache, ref_cache = _greedy_run(QWEN_MOE, batch=4, steps=3, interpret=interpret, padding_row=True)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


def test_grouped_routing_and_gated_shared_expert_match_xla(interpret):
    weights, cache, bt, tok, pos = _setup(GROUPED, batch=2)
    weights = _with_score_bias(weights, GROUPED)
    options = dataclasses.replace(OPTIONS, interpret=interpret)
    logits, _, kcache = _kernel_step(GROUPED, options)(weights, tok[:, None], pos[:, None], cache, bt)
    ref, _, ref_cache = _xla_step(GROUPED)(weights, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(logits, ref) < 1e-3
    _assert_caches_close(kcache, ref_cache)
    # the bias changes the choice: without it the XLA logits differ (so the kernel used it)
    unbiased = {**weights, "layers": [{**lw, "moe": {**lw["moe"], "score_bias": jnp.zeros(8)}} for lw in weights["layers"]]}
    other, _, _ = _xla_step(GROUPED)(unbiased, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(other, ref) > 1e-3
    assert not races_found()


def test_int8_expert_stacks_match_xla_on_dequantized_weights(interpret):
    weights, cache, bt, tok, pos = _setup(QWEN_MOE, batch=2, seed=3)
    quantized = _quantized(weights, QWEN_MOE)
    stack = quantized["layers"][0]["moe"]["w_gate"]
    assert quant.is_quantized(stack) and stack.fmt == "int8_channel" and stack.shape == (6, 128, 32)
    options = dataclasses.replace(OPTIONS, interpret=interpret)
    logits, _, _ = _kernel_step(QWEN_MOE, options)(quantized, tok[:, None], pos[:, None], cache, bt)
    ref, _, _ = _xla_step(QWEN_MOE)(_dequantized(quantized), tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(logits, ref) < 1e-3
    assert not races_found()


# Wider than one int4 group: gate / up read 160 inputs (a whole group of 128 and a partial one),
# down 136 (the same), so the padding inside the last group is exercised
WIDE_MOE = dataclasses.replace(QWEN_MOE, hidden_size=160, moe=dataclasses.replace(QWEN_MOE.moe, intermediate_size=136))


@pytest.mark.parametrize("cfg", [QWEN_MOE, pytest.param(WIDE_MOE, marks=pytest.mark.slow)], ids=["narrow", "wide"])
def test_int4_g128_experts_beside_int8_matrices_match_xla(interpret, cfg):
    """`quantization="int8_channel_int4_experts"` (the seeds' mix): expert stacks int4 with a
    scale and min per 128 inputs, every other matrix int8 per channel, quantized once at load;
    the kernel streams the packed codes with their groups' scales and mins and unpacks them in
    VMEM: the XLA path's logits on the same tree, at batch 2 (four routed pairs per layer)."""
    quantized = _int8_matches_xla(cfg, interpret, mode="int8_channel_int4_experts", batch=2)
    stack, dense = quantized["layers"][0]["moe"]["w_gate"], quantized["layers"][1]["w_gate"]
    assert stack.fmt == "int4_g128_rows" and dense.fmt == "int8_channel"
    spec = megakernel.spec_for(cfg, batch=2, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32, int8=True,
                               int4_experts=True)
    groups = -(-cfg.hidden_size // 128)
    expert_tiles = [t for t in mkplan.stream_schedule(spec, tile_rows=16) if t.pair == 0 and t.matrix == "gate"]
    assert expert_tiles[0].nbytes == expert_tiles[0].rows * groups * (64 + 8)  # packed codes, scale and min


def test_planted_wrong_expert_is_caught(interpret):
    """Each pair's DMA reads the next expert: the logits move (the control is the test above)."""
    cfg = QWEN_MOE
    weights, cache, bt, tok, pos = _setup(cfg, batch=2)
    spec = megakernel.spec_for(cfg, batch=2, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32,
                               pages_per_kv_tile=2)
    logits, *_ = mk.decode_step(spec, megakernel.kernel_params(cfg, weights), tok[:, None], pos[:, None], bt,
                                [p.k for p in cache.layers], [p.v for p in cache.layers], tile_rows=16,
                                vocab_tile_rows=32, ring_depth=3, interpret=interpret, route=megakernel.router(cfg),
                                _bug="wrong_expert")
    ref, _, _ = _xla_step(cfg)(weights, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(logits, ref) > 1e-3


def test_hidden_states_out_equal_xla_capture(interpret):
    """capture_layers: the residual streams after those layers, as `llama.forward` returns them
    (the DSpark drafter's features), on a verify-shaped block of 2 tokens per row."""
    cfg = QWEN_MOE
    weights, cache, bt, tok, pos = _setup(cfg, batch=2, seed=4)
    block = jnp.stack([tok, (tok + 5) % cfg.vocab_size], axis=1)
    positions = pos[:, None] + jnp.arange(2)[None]
    options = dataclasses.replace(OPTIONS, interpret=interpret)
    run = lambda fwd: fwd(weights, cfg, block, positions, cache, megakernel.AttentionBatch(bt),  # noqa: E731
                          capture_layers=(0, 2))
    logits, states, _ = run(lambda *a, **k: megakernel.forward(*a, **k, options=options))
    ref_logits, ref_states, _ = run(llama.forward)
    assert states.shape == ref_states.shape == (2, 2, 2 * cfg.hidden_size)
    assert _rel_err(states, ref_states) < 1e-4
    assert _rel_err(logits, ref_logits) < 1e-3


def test_moe_validation_and_support():
    spec = megakernel.spec_for(QWEN_MOE, batch=1, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    weights, cache, bt, tok, pos = _setup(QWEN_MOE, batch=1)
    params = megakernel.kernel_params(QWEN_MOE, weights)
    pools = [p.k for p in cache.layers], [p.v for p in cache.layers]
    with pytest.raises(ValueError, match="needs route="):
        mk.decode_step(spec, params, tok[:, None], pos[:, None], bt, *pools)
    bad = dict(params, layers=[dict(params["layers"][0], gate=jnp.zeros((5, 128, 32)))] + params["layers"][1:])
    with pytest.raises(ValueError, match=r"layers\[0\]\['gate'\] must be \[experts, out, in\] = \(6, 128, 32\)"):
        mk.decode_step(spec, bad, tok[:, None], pos[:, None], bt, *pools, route=megakernel.router(QWEN_MOE))
    with pytest.raises(ValueError, match=r"top_k \(7\) exceeds the routed experts \(6\)"):
        dataclasses.replace(spec, top_k=7)
    with pytest.raises(ValueError, match=r"layers\[0\]\['b_gate'\] must be \(6, 128\), got None"):
        mk.decode_step(dataclasses.replace(spec, expert_bias=True), params, tok[:, None], pos[:, None], bt, *pools,
                       route=megakernel.router(QWEN_MOE))
