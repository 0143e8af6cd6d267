"""Linear attention in the decode megakernel (Gated DeltaNet: Qwen3-Next / Qwen3.5; KDA: Kimi
Linear), in hybrid layer schedules with full attention and MoE, against the families' XLA
forward (`weld.models.qwen3_next.forward`, `weld.models.kimi_linear.forward`), in Pallas TPU
interpret mode: each row's conv window and delta-rule state read from its slot into VMEM and
written back in place, verify blocks, state slots as the batch assigns them (none, fresh rows),
and planted state bugs that the checks catch."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpret_mode import races_found
from test_megakernel_decode import (OPTIONS, PAGE, _assert_caches_close, _greedy_run, _int8_matches_xla, _rel_err, _setup,
                                    _verify_block, _xla_step)

from weld.kernels.megakernel import decode as mk
from weld.kernels.megakernel import plan as mkplan
from weld.models import kimi_linear, megakernel, qwen3_next
from weld.models.common import linear_attention as la
from weld.models.common import moe as moe_lib
from weld.models.common.cache import AttentionBatch
from weld.models.common.mla import MLA, mla_scale
from weld.models.common.rope import RopeScaling

LIN, FULL = "linear_attention", "full_attention"
# Qwen3-Next in miniature: 3 Gated DeltaNet layers to 1 gated full-attention layer (partial RoPE over
# 4 of 16 dims, qkv and o biases, (1 + w) norms), 2 key heads serving 4 value heads, softmax top-2
# experts with a gated shared expert on layers 1 and 3, dense MLPs on 0 and 2
NEXT = qwen3_next.Config(
    architecture="qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16, layer_types=(LIN, LIN, LIN, FULL),
    linear=la.DeltaNet(num_k_heads=2, num_v_heads=4, k_dim=8, v_dim=12, conv_width=4), rotary_dim=4,
    attention_bias=True, moe=moe_lib.MoE(num_experts=4, top_k=2, intermediate_size=16, shared_intermediate_size=24,
                                         shared_gate=True), sparse_layers=(1, 3))
# the smallest hybrid: one linear layer, one full one, dense MLPs
NEXT_SMALL = dataclasses.replace(NEXT, num_layers=2, layer_types=(LIN, FULL), moe=None, sparse_layers=())
# Kimi Linear in miniature: KDA (a decay per key channel, q/k/v convs) and NoPE MLA layers, a dense
# first layer, then sigmoid group-limited routing with a correction bias and a shared expert
KIMI = kimi_linear.Config(
    architecture="kimi_linear", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=4,
    layer_types=(LIN, FULL, LIN, FULL),
    linear=la.DeltaNet(num_k_heads=4, num_v_heads=4, k_dim=8, v_dim=8, conv_width=4, kind="kda", norm_eps=1e-5),
    mla=MLA(num_heads=4, q_lora_rank=None, kv_lora_rank=16, nope_dim=8, rope_dim=8, v_dim=8, rope=None,
            scale=mla_scale(8, 8, RopeScaling())),
    moe=moe_lib.MoE(num_experts=4, top_k=2, intermediate_size=16, router="sigmoid_group", n_group=2, topk_group=1,
                    score_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5, shared_intermediate_size=16),
    sparse_layers=(1, 2, 3), rms_norm_eps=1e-5)


def _kda_weights(weights, rng):
    """KDA as the megakernel reads it: the three convs as one (`prepare_weights`' megakernel form)."""
    for lw in weights["layers"]:
        la.fuse_convs(lw)


_setup_kimi = functools.partial(_setup, adjust=_kda_weights)


def test_hybrid_schedule_streams_each_kind_in_layer_order():
    spec = megakernel.spec_for(NEXT, batch=2, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    assert spec.linear_layers == (0, 1, 2) and spec.attention_layers == (3,)
    assert (spec.rope_dims, spec.q_proj_dim, spec.conv_channels) == (4, 2 * 4 * 16, 2 * 16 + 48)
    tiles = mkplan.stream_schedule(spec, tile_rows=32, vocab_tile_rows=32)
    order = [t.matrix for t in tiles if t.layer in (0, 3) and t.pair < 0]
    assert order[:5] == ["w_qkv", "w_qkv", "w_qkv", "w_z", "w_z"][:5]
    assert order.index("w_out") < order.index("gate") and "q" not in order[:order.index("gate")]
    assert [m for m in order if m in ("q", "k", "v", "o")] == ["q"] * 4 + ["k", "v", "o"]  # layer 3: 128 q rows
    kimi = megakernel.spec_for(KIMI, batch=1, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    names = [n for n, _, _ in kimi.matrices(0)]
    assert names[:9] == ["w_q", "w_k", "w_v", "w_b", "w_fa", "w_ga", "w_fb", "w_gb", "w_out"]
    assert not kimi.rope and kimi.attention_layers == (1, 3)
    # the HBM floor counts each row's state twice (read, written) per linear layer
    state = 4 * (kimi.conv_channels * 3 + 4 * 8 * 8)
    assert mkplan.step_bytes(dataclasses.replace(kimi, batch=2), 8) - mkplan.step_bytes(kimi, 8) >= 2 * 2 * state


def test_qwen3_next_batch4_with_padding_matches_xla(interpret):
    """GDN layers, gated full attention with partial RoPE, MoE: batch 4 with a padding row, 3
    greedy steps, every row continuing the state its prompt left in its slot."""
    errors, cache, ref_cache = _greedy_run(NEXT, batch=4, steps=3, interpret=interpret, padding_row=True)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


def test_kimi_linear_verify_block_matches_steps_and_xla(interpret):
    """KDA and NoPE MLA: a 3-token verify block per row (the conv window and state advance
    through the block) equals three one-token kernel steps and the XLA forward. The block and
    the steps contract the recurrence over other shapes: the caches agree to f32 rounding (1e-5),
    not bit for bit."""
    _verify_block(KIMI, 2, interpret, setup=_setup_kimi, step_tol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    dataclasses.replace(NEXT_SMALL, linear=dataclasses.replace(NEXT.linear, tiled_v_heads=True)),
    dataclasses.replace(KIMI, linear=dataclasses.replace(KIMI.linear, gate_lower_bound=-5.0))],
    ids=["gdn_tiled_v_heads", "kda_gate_lower_bound"])
def test_linear_variants_match_xla(interpret, cfg):
    adjust = _kda_weights if cfg.linear.kind == "kda" else None
    errors, cache, ref_cache = _greedy_run(cfg, batch=2, steps=2, interpret=interpret, adjust=adjust)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)


@functools.lru_cache(maxsize=None)
def _slotted(cfg, kernel: bool):
    options = dataclasses.replace(OPTIONS, interpret=True)
    if kernel:
        fn = lambda w, tok, pos, cache, bt, slots: megakernel.forward(w, cfg, tok, pos, cache,  # noqa: E731
                                                                      AttentionBatch(bt, slots), options=options)
    else:
        fn = lambda w, tok, pos, cache, bt, slots: qwen3_next.forward(w, cfg, tok, pos, cache,  # noqa: E731
                                                                      AttentionBatch(bt, slots))
    return jax.jit(fn)


def test_state_slots_as_the_batch_assigns_them(interpret):
    """Rows read and write the slots `state_slots` names: row 0 continues from slot 2 (another
    row's prompt), row 1 has no slot (computes from zeros, writes nothing), row 2 starts fresh
    at position 0 in slot 1, which holds garbage it must not read, and overwrites it."""
    weights, cache, bt, tok, pos = _setup(NEXT_SMALL, batch=3)
    linear = cache.layers[0]
    poisoned = dataclasses.replace(linear, conv=linear.conv.at[1].set(1e3), state=linear.state.at[1].set(1e3))
    cache = dataclasses.replace(cache, layers=[poisoned] + cache.layers[1:])
    slots = jnp.asarray([2, -1, 1], jnp.int32)
    positions = pos.at[2].set(0)[:, None]
    logits, _, kcache = _slotted(NEXT_SMALL, True)(weights, tok[:, None], positions, cache, bt, slots)
    ref, _, ref_cache = _slotted(NEXT_SMALL, False)(weights, tok[:, None], positions, cache, bt, slots)
    assert _rel_err(logits, ref) < 1e-3
    _assert_caches_close(kcache, ref_cache)
    state = np.asarray(kcache.layers[0].state)
    np.testing.assert_array_equal(state[3], np.asarray(cache.layers[0].state)[3])  # no row's slot: untouched
    assert np.abs(state[1]).max() < 1e2  # the fresh row's state replaced the garbage
    assert not races_found()


@pytest.mark.parametrize("bug", ["stale_state", pytest.param("skip_state_wait", marks=pytest.mark.slow)])
def test_planted_state_bug_is_caught(interpret, bug):
    """The checks can fail: a state never written back leaves the slot stale (the next step
    would continue from the old state), and a state computed before its read landed is NaN."""
    cfg = NEXT_SMALL
    weights, cache, bt, tok, pos = _setup(cfg, batch=2)
    spec = megakernel.spec_for(cfg, batch=2, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32,
                               pages_per_kv_tile=2)
    pools = [(s.conv, s.state) for s in cache.layers[:1]]
    attn = cache.layers[1]
    logits, _, _, _, _, states = mk.decode_step(
        spec, megakernel.kernel_params(cfg, weights), tok[:, None], pos[:, None], bt, [attn.k], [attn.v],
        linear_states=pools, tile_rows=16, vocab_tile_rows=32, ring_depth=3, interpret=interpret, _bug=bug)
    ref, _, ref_cache = _xla_step(cfg)(weights, tok[:, None], pos[:, None], cache, bt)
    if bug == "stale_state":
        assert _rel_err(logits, ref) < 1e-3  # this step is right ...
        assert not np.allclose(np.asarray(states[0][1]), np.asarray(ref_cache.layers[0].state), atol=1e-3)  # ... its slot is not
    else:
        assert not np.allclose(np.asarray(logits), np.asarray(ref), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cfg", [NEXT_SMALL, pytest.param(KIMI, marks=pytest.mark.slow)], ids=["gdn", "kda"])
def test_int8_hybrid_streams_int8_and_float_matrices(interpret, cfg):
    """`quantization="int8_channel"` on a hybrid: the large projections are int8, the small ones
    (beta, the decays, KDA's low-rank pairs) stay float as declared; the kernel streams both
    kinds and matches the XLA path on the same tree."""
    quantized = _int8_matches_xla(cfg, interpret)  # prepare_weights fuses KDA's convs
    floats = megakernel.float_matrices(megakernel.kernel_params(cfg, quantized))
    assert "w_b" in floats and "w_out" not in floats


def test_linear_validation():
    spec = megakernel.spec_for(NEXT_SMALL, batch=1, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    with pytest.raises(ValueError, match="value heads .* multiple of key heads"):
        dataclasses.replace(spec, linear_v_heads=3)
    with pytest.raises(ValueError, match="only KDA has one"):
        dataclasses.replace(spec, gate_lower_bound=-1.0)
    weights, cache, bt, tok, pos = _setup(NEXT_SMALL, batch=1)
    attn, state = cache.layers[1], cache.layers[0]
    params = megakernel.kernel_params(NEXT_SMALL, weights)
    with pytest.raises(ValueError, match="1 linear layers need as many"):
        mk.decode_step(spec, params, tok[:, None], pos[:, None], bt, [attn.k], [attn.v])
    with pytest.raises(ValueError, match=r"state pools of layer 0 must be f32"):
        mk.decode_step(spec, params, tok[:, None], pos[:, None], bt, [attn.k], [attn.v],
                       linear_states=[(state.conv, state.state[..., :4])])
