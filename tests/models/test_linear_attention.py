"""The gated delta rule and its conv: the chunked form against the recurrent twin and a numpy
statement, state carried across calls, padding; hybrid models against HF across chunk boundaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from weld.models.common import linear_attention as la
from weld.models.common.cache import AttentionBatch
from weld.weights import ModelSource, load_model


def numpy_delta_rule(q, k, v, g, beta, state):
    """The recurrence as the architecture notes state it, one token and head at a time (float64)."""
    b, t, h, _ = q.shape
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for i in range(b):
        for j in range(t):
            for n in range(h):
                s[i, n] *= np.exp(g[i, j, n])
                delta = beta[i, j, n] * (v[i, j, n] - s[i, n].T @ k[i, j, n])
                s[i, n] += np.outer(k[i, j, n], delta)
                out[i, j, n] = s[i, n].T @ q[i, j, n]
    return out, s


def random_inputs(rng, b, t, h, dk, dv):
    q = la.l2norm(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32)) * dk ** -0.5
    k = la.l2norm(jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 0.5, (b, t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, h)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_forms_agree_with_numpy(t):
    """Both forms from a nonzero state, across 64-token chunk boundaries (150 = 2 x 64 + 22)."""
    args = random_inputs(np.random.default_rng(t), 2, t, 3, 8, 12)
    want_o, want_s = numpy_delta_rule(*(np.asarray(a) for a in args))
    for form in (la.delta_rule_recurrent, la.delta_rule_chunked):
        o, s = jax.jit(form)(*args)
        np.testing.assert_allclose(np.asarray(o), want_o, atol=2e-5, rtol=1e-4, err_msg=form.__name__)
        np.testing.assert_allclose(np.asarray(s), want_s, atol=2e-5, rtol=1e-4, err_msg=form.__name__)


def test_state_carries_across_calls_and_padding_leaves_it():
    """Two calls of 40 and 110 tokens equal one of 150; tokens with beta = g = 0 change nothing."""
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(7), 1, 150, 2, 8, 8)
    o_all, s_all = la.delta_rule_chunked(q, k, v, g, beta, state)
    o1, s1 = la.delta_rule_chunked(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], state)
    o2, s2 = la.delta_rule_chunked(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], s1)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o_all, atol=2e-5)
    np.testing.assert_allclose(s2, s_all, atol=2e-5)
    zero = jnp.zeros_like(g[:, :30])
    _, s_pad = la.delta_rule_chunked(q[:, :70], k[:, :70], v[:, :70], jnp.concatenate([g[:, :40], zero], 1),
                                     jnp.concatenate([beta[:, :40], zero], 1), state)
    np.testing.assert_allclose(s_pad, s1, atol=2e-5)


def test_causal_conv_continues_its_window():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 9, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
    zero = jnp.zeros((2, 5, 3), jnp.float32)
    full, window = la.causal_conv(x, zero, w, jnp.asarray([9, 9], jnp.int32))
    want = np.zeros((2, 9, 5))
    xn = np.asarray(x)
    for t in range(9):
        for j in range(4):
            if t - 3 + j >= 0:
                want[:, t] += np.asarray(w)[:, j] * xn[:, t - 3 + j]
    np.testing.assert_allclose(full, want, atol=1e-5)
    first, win = la.causal_conv(x[:, :4], zero, w, jnp.asarray([4, 4], jnp.int32))
    rest, win2 = la.causal_conv(x[:, 4:], win, w, jnp.asarray([5, 5], jnp.int32))
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), full, atol=1e-5)
    np.testing.assert_allclose(win2, window, atol=0)
    # a row with 2 valid tokens of 4 keeps the window that ends at its second token
    _, short = la.causal_conv(x[:, :4], zero, w, jnp.asarray([2, 4], jnp.int32))
    np.testing.assert_allclose(short[0], np.concatenate([np.zeros((5, 1)), xn[0, :2].T], axis=1), atol=0)


HYBRIDS = ["qwen3_next", "kimi_linear"]  # GDN and KDA (Qwen3.5: test_families_vs_hf, the GGUF tests)


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, tiny_model_dir):
    directory, hf_model = tiny_model_dir(request.param)
    return load_model(ModelSource("hf", directory, request.param), dtype="float32"), hf_model


def _forward(loaded, cache, tokens, positions, tables, slots):
    spec = loaded.family.cache_spec(loaded.cfg)
    logits, _, cache = jax.jit(loaded.family.forward, static_argnums=(1,))(
        loaded.weights, loaded.cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache,
        AttentionBatch(spec.tables(jnp.asarray(tables, jnp.int32)), jnp.asarray(slots, jnp.int32)))
    return np.asarray(logits), cache


def test_long_prompt_in_chunks_matches_hf(hybrid):
    """150 tokens (chunks of the delta rule: 64 + 64 + 22) fed in two calls of 100 and 50 from slot 3,
    then two decode steps: HF's logits throughout."""
    loaded, hf_model = hybrid
    rng = np.random.default_rng(5)
    ids = rng.integers(0, loaded.cfg.vocab_size, 152).tolist()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    spec = loaded.family.cache_spec(loaded.cfg)
    cache = spec.create(num_pages=48, page_size=4, dtype=jnp.float32, num_slots=5)
    table = [list(range(47, 7, -1))]
    logits, cache = _forward(loaded, cache, [ids[:100]], [list(range(100))], table, [3])
    np.testing.assert_allclose(logits[0], ref[:100], atol=1e-4, rtol=0)
    logits, cache = _forward(loaded, cache, [ids[100:150]], [list(range(100, 150))], table, [3])
    np.testing.assert_allclose(logits[0], ref[100:150], atol=1e-4, rtol=0)
    for pos in (150, 151):
        logits, cache = _forward(loaded, cache, [[ids[pos]]], [[pos]], table, [3])
        np.testing.assert_allclose(logits[0, 0], ref[pos], atol=1e-4, rtol=0)
    untouched = [i for i in range(5) if i != 3]
    assert all(float(jnp.abs(leaf[np.asarray(untouched)]).max()) == 0.0 for leaf in jax.tree.leaves(cache.take_slots(jnp.arange(5)))), \
        "rows write only their own slot"


def test_grouped_rows_use_their_slots(hybrid):
    """A mixed call (a prompt chunk group, then a decode-row group, one padding row without a
    slot) equals the same rows run one by one."""
    loaded, _ = hybrid
    rng = np.random.default_rng(8)
    spec = loaded.family.cache_spec(loaded.cfg)
    a = rng.integers(0, loaded.cfg.vocab_size, 20).tolist()
    b = rng.integers(0, loaded.cfg.vocab_size, 7).tolist()
    tables = [list(range(0, 8)), list(range(8, 16))]

    def prefill_b(cache):
        return _forward(loaded, cache, [b[:6]], [list(range(6))], [tables[1]], [1])[1]

    cache = prefill_b(spec.create(num_pages=16, page_size=4, dtype=jnp.float32, num_slots=3))
    groups_tokens = ([a], [[b[6]], [0]])
    groups_pos = ([list(range(20))], [[6], [-1]])
    t = lambda rows: spec.tables(jnp.asarray(rows, jnp.int32))
    batch = AttentionBatch((t([tables[0]]), t([tables[1], tables[1]])),
                           (jnp.asarray([0], jnp.int32), jnp.asarray([1, -1], jnp.int32)))
    logits, _, _ = jax.jit(loaded.family.forward, static_argnums=(1,))(
        loaded.weights, loaded.cfg, tuple(jnp.asarray(x, jnp.int32) for x in groups_tokens),
        tuple(jnp.asarray(x, jnp.int32) for x in groups_pos), cache, batch)
    alone = prefill_b(spec.create(num_pages=16, page_size=4, dtype=jnp.float32, num_slots=3))
    want_b, _ = _forward(loaded, alone, [[b[6]]], [[6]], [tables[1]], [1])
    want_a, _ = _forward(loaded, spec.create(num_pages=16, page_size=4, dtype=jnp.float32, num_slots=3),
                         [a], [list(range(20))], [tables[0]], [0])
    np.testing.assert_allclose(np.asarray(logits[0])[0], want_a[0], atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[1])[0], want_b[0], atol=1e-5)


@pytest.mark.parametrize("t", [6, 70])
def test_per_channel_decay_forms_agree(t):
    """KDA's decay, one log-decay per key channel, in both forms against numpy."""
    rng = np.random.default_rng(t + 100)
    q, k, v, _, beta, state = random_inputs(rng, 2, t, 2, 8, 6)
    g = -jnp.asarray(rng.uniform(0.0, 0.6, (2, t, 2, 8)), jnp.float32)
    b_, t_, h_, _ = q.shape
    s = np.asarray(state, np.float64).copy()
    want = np.zeros(v.shape)
    qn, kn, vn, gn, bn = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    for i in range(b_):
        for j in range(t_):
            for n in range(h_):
                s[i, n] *= np.exp(gn[i, j, n])[:, None]
                delta = bn[i, j, n] * (vn[i, j, n] - s[i, n].T @ kn[i, j, n])
                s[i, n] += np.outer(kn[i, j, n], delta)
                want[i, j, n] = s[i, n].T @ qn[i, j, n]
    for form in (la.delta_rule_recurrent, la.delta_rule_chunked):
        o, st = jax.jit(form)(q, k, v, g, beta, state)
        np.testing.assert_allclose(np.asarray(o), want, atol=2e-5, rtol=1e-4, err_msg=form.__name__)
        np.testing.assert_allclose(np.asarray(st), s, atol=2e-5, rtol=1e-4, err_msg=form.__name__)


def test_kda_log_decay_with_and_without_a_lower_bound():
    rng = np.random.default_rng(4)
    f = jnp.asarray(rng.standard_normal((3, 2, 4)) * 5, jnp.float32)
    a_log = jnp.asarray(rng.standard_normal(2), jnp.float32)
    rate = np.exp(np.asarray(a_log))[:, None]
    plain = la.DeltaNet(2, 2, 4, 4, 4, kind="kda")
    np.testing.assert_allclose(la.kda_log_decay(plain, a_log, f), -rate * np.log1p(np.exp(np.asarray(f))), rtol=1e-5)
    bounded = la.DeltaNet(2, 2, 4, 4, 4, kind="kda", gate_lower_bound=-5.0)
    g = np.asarray(la.kda_log_decay(bounded, a_log, f))
    np.testing.assert_allclose(g, -5.0 / (1 + np.exp(-rate * np.asarray(f))), rtol=1e-5)
    assert g.min() >= -5.0 and g.max() <= 0
    with pytest.raises(ValueError, match="lower bound"):
        la.DeltaNet(2, 2, 4, 4, 4, kind="gdn", gate_lower_bound=-5.0)


def test_qwen3_5_vlm_checkpoint_loads_its_text_model(tiny_model_dir, tmp_path):
    """A Qwen3.5 VLM checkpoint (config under text_config, tensors under model.language_model.,
    a vision tower and an MTP head beside them) loads as its text model and computes the same logits."""
    import json

    from safetensors.numpy import load_file, save_file

    directory, _ = tiny_model_dir("qwen3_5_text")
    text = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 2), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    save_file(renamed, str(vlm / "model.safetensors"))
    (vlm / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                 "model_type": "qwen3_5", "text_config": text,
                                                 "vision_config": {"depth": 1},
                                                 "tie_word_embeddings": text["tie_word_embeddings"]}))
    plain = load_model(ModelSource("hf", directory, "text"), dtype="float32")
    wrapped = load_model(ModelSource("hf", vlm, "vlm"), dtype="float32")
    assert wrapped.cfg == plain.cfg
    outs = []
    for loaded in (plain, wrapped):
        spec = loaded.family.cache_spec(loaded.cfg)
        cache = spec.create(num_pages=4, page_size=4, dtype=jnp.float32, num_slots=1)
        outs.append(_forward(loaded, cache, [[5, 6, 7, 8, 9]], [list(range(5))], [[0, 1]], [0])[0])
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["gdn", "gdn_tiled", "kda"])
def test_grouped_channels_compute_as_flat(kind):
    """`DeltaNet.shards` (the tensor-parallel megakernel's layout: w_qkv's rows, the conv's and
    the conv windows' channels in groups of [q | k | v] per device's heads) gives the XLA
    forward the flat layout's outputs and states, prefill (across a chunk boundary) and decode;
    the grouped windows are the flat ones reordered. Tiled value heads (llama.cpp's Qwen3.5
    order) are regrouped by key head in that layout (`la.value_head_order`): the same outputs,
    the states' value heads reordered."""
    import dataclasses

    from weld.models import kimi_linear, qwen3_next
    from weld.models.common import moe as moe_lib
    from weld.models.common.mla import MLA, mla_scale
    from weld.models.common.rope import RopeScaling
    from weld.models.common.spec import random_weights
    from weld.models.family import WeightTarget

    lin, full = "linear_attention", "full_attention"
    if kind.startswith("gdn"):
        family = qwen3_next
        cfg = qwen3_next.Config(
            architecture="qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, layer_types=(lin, full), rotary_dim=4,
            linear=la.DeltaNet(num_k_heads=4, num_v_heads=8, k_dim=8, v_dim=4, conv_width=4,
                               tiled_v_heads=kind == "gdn_tiled"))
    else:
        family = kimi_linear
        cfg = kimi_linear.Config(
            architecture="kimi_linear", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2,
            layer_types=(lin, full), sparse_layers=(),
            linear=la.DeltaNet(num_k_heads=4, num_v_heads=4, k_dim=8, v_dim=8, conv_width=4, kind="kda"),
            mla=MLA(num_heads=4, q_lora_rank=None, kv_lora_rank=16, nope_dim=8, rope_dim=8, v_dim=8, rope=None,
                    scale=mla_scale(8, 8, RopeScaling())),
            moe=moe_lib.MoE(num_experts=4, top_k=2, intermediate_size=16))
    grouped = dataclasses.replace(cfg, linear=dataclasses.replace(cfg.linear, shards=2))
    order = la.stored_channels(grouped.linear)
    assert sorted(order) == list(range(cfg.linear.conv_channels)) and list(order) != sorted(order)
    heads = la.value_head_order(grouped.linear)
    assert (heads is not None) == (kind == "gdn_tiled")
    heads = np.arange(cfg.linear.num_v_heads) if heads is None else heads
    assert heads.tolist() == ([0, 4, 1, 5, 2, 6, 3, 7] if kind == "gdn_tiled" else list(range(len(heads))))
    weights = random_weights(family.weight_specs(cfg), seed=3)
    target = WeightTarget(backend="megakernel")
    flat_w = family.prepare_weights(jax.tree.map(lambda a: a, weights), cfg, target)
    grouped_w = family.prepare_weights(jax.tree.map(lambda a: a, weights), grouped, target)
    rng = np.random.default_rng(0)
    runs = []
    for c, w in ((cfg, flat_w), (grouped, grouped_w)):
        cache = family.cache_spec(c).create(16, 8, jnp.float32, num_slots=2)
        fwd = jax.jit(lambda w, t, p, cache, c=c: family.forward(w, c, t, p, cache, AttentionBatch(
            jnp.arange(16, dtype=jnp.int32).reshape(2, 8), jnp.arange(2, dtype=jnp.int32))))
        rng = np.random.default_rng(0)
        tokens = jnp.asarray(rng.integers(0, 64, (2, 70)), jnp.int32)
        logits, _, cache = fwd(w, tokens, jnp.broadcast_to(jnp.arange(70), (2, 70)).astype(jnp.int32), cache)
        step, _, cache = fwd(w, tokens[:, :1], jnp.full((2, 1), 70, jnp.int32), cache)
        runs.append((np.asarray(logits), np.asarray(step), cache.layers[0]))
    (flat_logits, flat_step, flat_state), (g_logits, g_step, g_state) = runs
    np.testing.assert_allclose(g_logits, flat_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(g_step, flat_step, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_state.conv), np.asarray(flat_state.conv)[:, order], atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_state.state), np.asarray(flat_state.state)[:, heads], atol=1e-5)
