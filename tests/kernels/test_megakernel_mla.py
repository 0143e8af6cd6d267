"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in the decode megakernel, against the
XLA path (`weld.models.deepseek.forward`, absorbed MLA in `weld.models.common.mla`), in Pallas TPU
interpret mode: the latent pool written in place and read as keys and values, W_UK folded into
the query tile by tile (whole heads per tile), W_UV on the latent output, q LoRA or a plain q,
interleaved YaRN RoPE with its mscale, and the deepseek layer stack (a dense first layer, then
sparse layers with group-limited sigmoid routing and a shared expert)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import pytest
from interpret_mode import races_found
from test_megakernel_decode import (OPTIONS, PAGE, _assert_caches_close, _greedy_run, _int8_matches_xla, _kernel_step, _rel_err,
                                    _setup, _xla_step)

from weld.kernels.megakernel import decode as mk
from weld.kernels.megakernel import plan as mkplan
from weld.models import deepseek
from weld.models import megakernel
from weld.models.common import moe as moe_lib
from weld.models.common import quant
from weld.models.common.mla import MLA, mla_scale
from weld.models.common.rope import Rope, RopeScaling

YARN = RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)
# DeepSeek-V3 / Kimi K2 in miniature: q LoRA, interleaved YaRN RoPE, a dense first layer, then
# sigmoid routing over 2 of 4 groups with a correction bias and a shared expert; 32 heads, so that
# W_UK and W_UV stream as loops over tiles of 8 whole heads (`plan.HEAD_ALIGN`)
V3 = deepseek.Config(
    architecture="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
    mla=MLA(num_heads=32, q_lora_rank=24, kv_lora_rank=16, nope_dim=8, rope_dim=8, v_dim=12,
            rope=Rope(8, 1e4, YARN, 64, interleaved=True), scale=mla_scale(8, 8, YARN)),
    moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=16, router="sigmoid_group", n_group=4, topk_group=2,
                    score_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5, shared_intermediate_size=16),
    first_k_dense_replace=1)
# DeepSeek-V2-Lite-like: a plain q projection, rotate-half RoPE, every layer dense
V2_DENSE = dataclasses.replace(
    V3, architecture="deepseek_v2", num_layers=2, moe=None, first_k_dense_replace=2,
    mla=MLA(num_heads=2, q_lora_rank=None, kv_lora_rank=16, nope_dim=8, rope_dim=4, v_dim=8,
            rope=Rope(4, 1e4), scale=mla_scale(8, 4, RopeScaling())))


def _score_bias(weights, rng):
    """A correction bias that changes which experts win (the random init is zeros)."""
    for lw in weights["layers"]:
        if "score_bias" in lw.get("moe", {}):
            lw["moe"]["score_bias"] = jnp.asarray(rng.normal(0, 0.3, lw["moe"]["score_bias"].shape), jnp.float32)


_setup = functools.partial(_setup, adjust=_score_bias)


def test_mla_schedule_keeps_whole_heads_per_tile():
    spec = megakernel.spec_for(V3, batch=1, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    assert (spec.num_kv_heads, spec.head_dim, spec.attention) == (1, 16 + 8, "mla")
    tiles = mkplan.stream_schedule(spec, tile_rows=20, vocab_tile_rows=32)
    layer0 = [(t.matrix, t.rows) for t in tiles if t.layer == 0]
    # q_a 24 rows -> 20 + 4; q_b 32 x 16 -> 20s; kv_a 24; W_UK 32 heads x 8 and W_UV 32 x 12: whole heads,
    # 2 and 1 of them in 20 rows, rounded up to HEAD_ALIGN = 8 per tile (so a looped tile's head offset
    # is a multiple of 8: Mosaic must prove it aligned); o 32 rows
    assert [r for m, r in layer0 if m == "w_uk"] == [8 * 8] * 4
    assert [r for m, r in layer0 if m == "w_uv"] == [8 * 12] * 4
    few = mkplan.stream_schedule(megakernel.spec_for(V2_DENSE, batch=1, page_size=PAGE, weight_dtype=jnp.float32,
                                                     kv_dtype=jnp.float32), tile_rows=4, vocab_tile_rows=32)
    assert [t.rows for t in few if t.layer == 0 and t.matrix == "w_uv"] == [2 * 8]  # fewer heads than 8: all
    assert [m for m, _ in layer0][:3] == ["q_a", "q_a", "q_b"]


def test_v3_stack_batch4_with_padding_matches_xla(interpret):
    """q LoRA, interleaved YaRN RoPE, a dense layer then two sparse ones, 3 greedy steps."""
    errors, cache, ref_cache = _greedy_run(V3, batch=4, steps=3, interpret=interpret, padding_row=True,
                                           adjust=_score_bias)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


def test_v2_plain_q_verify_block_matches_xla(interpret):
    """A plain q projection and rotate-half RoPE; a verify-shaped block of 3 tokens per row,
    causal in the block, one row crossing a page boundary."""
    cfg = V2_DENSE
    weights, cache, bt, tok, pos = _setup(cfg, batch=2, seed=1)
    block = jnp.stack([tok, (tok + 3) % cfg.vocab_size, (tok + 7) % cfg.vocab_size], axis=1)
    positions = pos[:, None] + jnp.arange(3)[None]
    options = dataclasses.replace(OPTIONS, interpret=interpret)
    logits, _, kcache = _kernel_step(cfg, options)(weights, block, positions, cache, bt)
    ref, _, ref_cache = _xla_step(cfg)(weights, block, positions, cache, bt)
    assert _rel_err(logits, ref) < 1e-3
    _assert_caches_close(kcache, ref_cache)
    assert not races_found()


def test_a_wrong_latent_split_is_caught(interpret):
    """The check can fail: the same kernel told that the values are the latent's last dims (a
    W_UV applied to the wrong slice) gives other logits."""
    cfg = V2_DENSE
    weights, cache, bt, tok, pos = _setup(cfg, batch=1, seed=2)
    options = dataclasses.replace(OPTIONS, interpret=interpret)
    ref, _, _ = _xla_step(cfg)(weights, tok[:, None], pos[:, None], cache, bt)
    # swap W_UK and W_UV's roles is impossible by shape; permute the heads of W_UV instead
    bad = {**weights, "layers": [{**lw, "w_uv": lw["w_uv"][::-1]} for lw in weights["layers"]]}
    logits, _, _ = _kernel_step(cfg, options)(bad, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(logits, ref) > 1e-3
    good, _, _ = _kernel_step(cfg, options)(weights, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(good, ref) < 1e-3


def test_mla_validation():
    spec = megakernel.spec_for(V2_DENSE, batch=1, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        dataclasses.replace(spec, num_kv_heads=2)
    weights, cache, bt, tok, pos = _setup(V2_DENSE, batch=1)
    pools = [p.pool for p in cache.layers]
    with pytest.raises(ValueError, match="one latent pool per layer"):
        mk.decode_step(spec, megakernel.kernel_params(V2_DENSE, weights), tok[:, None], pos[:, None], bt, pools, pools)


def test_v2_without_rotary_embedding_matches_xla(interpret):
    """MLA with no rotation anywhere (`MLA.rope` None: Kimi Linear's NoPE layers) in the deepseek
    stack: its k_pe part still cached and scored, unrotated; 3 greedy steps at batch 2."""
    nope = dataclasses.replace(V2_DENSE, mla=dataclasses.replace(V2_DENSE.mla, rope=None))
    megakernel.check_supported(nope)
    errors, cache, ref_cache = _greedy_run(nope, batch=2, steps=3, interpret=interpret)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


def test_int8_with_float_latent_matrices_matches_xla(interpret):
    """`quantization="int8_channel"` on an MLA model: the declared projections are int8, W_UK and
    W_UV stay float (the declaration does not quantize them), and the kernel streams both kinds,
    each through a ring of its own: the XLA path's logits on the same tree."""
    quantized = _int8_matches_xla(V3, interpret, setup=_setup)
    lw = quantized["layers"][0]
    assert quant.is_quantized(lw["wkv_a"]) and not quant.is_quantized(lw["w_uk"])
    spec = megakernel.spec_for(V3, batch=1, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32, int8=True,
                               float_matrices=megakernel.float_matrices(megakernel.kernel_params(V3, quantized)))
    assert spec.float_matrices == ("w_uk", "w_uv")
    tiles = mkplan.stream_schedule(spec, tile_rows=16)
    assert {t.nbytes for t in tiles if t.matrix == "w_uk"} == {8 * 8 * 16 * 4}  # 8 heads of f32 rows, no scales
