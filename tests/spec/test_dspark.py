"""The DSpark drafter against a plain numpy statement of its equations, its checkpoints, and the
target features it reads (the family's forward with capture_layers) against the plain forward."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.engine.spec import dspark
from weld.engine.spec.features import target_hidden_states
from weld.models import llama
from weld.models.common.cache import AttentionBatch
from weld.models.llama import cache_spec
from weld.models.common.layers import rms_norm
from weld.models.common import quant
from weld.models.common.spec import random_weights

TARGET = llama.Config(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, qk_norm=True, sliding_window=5,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"))
DRAFT = dspark.DraftConfig(vocab_size=40, hidden_size=16, target_num_layers=3, target_layers=(2, 0), num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=6, intermediate_size=24, block_size=3,
                           markov_rank=5, rms_norm_eps=1e-5, rope_theta=500.0)


def paged_forward(weights, cfg, tokens):
    """llama.forward over whole sequences tokens [b, t] on a fresh paged cache."""
    b, t = tokens.shape
    page = 4
    cache = cache_spec(cfg).create(b * t // page, page, jnp.float32)
    tables = cache_spec(cfg).tables(jnp.arange(b * (t // page), dtype=jnp.int32).reshape(b, t // page))
    return jax.jit(llama.forward, static_argnames=("cfg",))(
        weights, cfg, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), cache, AttentionBatch(block_tables=tables))


@pytest.fixture(scope="module")
def target_features():
    weights = random_weights(llama.weight_specs(TARGET), seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TARGET.vocab_size, (2, 12)), jnp.int32)
    layers = (2, 0)  # out of order on purpose
    selected, final = jax.jit(functools.partial(target_hidden_states, llama), static_argnums=(1, 3))(weights, TARGET, tokens, layers)
    return weights, tokens, selected, final


def test_target_features_match_llama_forward(target_features):
    weights, tokens, selected, final = target_features
    logits, hidden, _ = paged_forward(weights, TARGET, tokens)
    np.testing.assert_allclose(final, hidden, atol=2e-5)
    np.testing.assert_allclose(final @ weights["lm_head"].T, logits, atol=1e-4)
    # The last layer's output (slot 0 here), normed, is the final hidden state.
    d = TARGET.hidden_size
    np.testing.assert_allclose(rms_norm(selected[..., :d], weights["final_norm"], TARGET.rms_norm_eps), hidden,
                               atol=2e-5)


@pytest.mark.slow
def test_target_features_of_an_inner_layer_match_llama_forward_cut_after_it(target_features):
    weights, tokens, selected, _ = target_features
    d = TARGET.hidden_size
    # llama.forward cut after layer 0, with a unit final norm, returns the RMSNorm of layer 0's output.
    cut = dataclasses.replace(TARGET, num_layers=1, layer_types=TARGET.layer_types[:1])
    _, normed, _ = paged_forward({**weights, "layers": weights["layers"][:1], "final_norm": jnp.ones(d)}, cut, tokens)
    np.testing.assert_allclose(rms_norm(selected[..., d:], jnp.ones(d), TARGET.rms_norm_eps), normed, atol=2e-5)


# ----- a numpy statement of the drafter's equations, one slot and one head at a time -----

def np_rms(x, w, eps=DRAFT.rms_norm_eps):
    return w * x / np.sqrt(np.mean(x * x) + eps)


def np_rope(x, position):  # x [e], rotate-half layout
    e = len(x)
    angle = position / DRAFT.rope_theta ** (np.arange(0, e, 2) / e)
    x1, x2 = x[:e // 2], x[e // 2:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)])


def np_block(p, target, features, ctx_positions, anchor, anchor_position):
    """Hidden states [k, d] of one block's mask slots."""
    h, kv, e, k = DRAFT.num_heads, DRAFT.num_kv_heads, DRAFT.head_dim, DRAFT.block_size
    context = [np_rms(p["fc"] @ f, p["context_norm"]) for f in features]
    slots = [target["embed"][anchor]] + [p["mask_embed"]] * k
    slot_positions = [anchor_position + j for j in range(k + 1)]
    for lw in p["layers"]:
        ys = [np_rms(x, lw["attn_norm"]) for x in slots]
        keys, values = [], []
        for c, pos in zip(context, ctx_positions):
            if 0 <= pos < anchor_position:
                keys.append([np_rope(kh, pos) for kh in (lw["wk"] @ c).reshape(kv, e)])
                values.append((lw["wv"] @ c).reshape(kv, e))
        for y, pos in zip(ys, slot_positions):
            keys.append([np_rope(kh, pos) for kh in (lw["wk"] @ y).reshape(kv, e)])
            values.append((lw["wv"] @ y).reshape(kv, e))
        new_slots = []
        for x, y, pos in zip(slots, ys, slot_positions):
            heads = []
            for head, qh in enumerate((lw["wq"] @ y).reshape(h, e)):
                group = head // (h // kv)
                q = np_rope(qh, pos)
                scores = np.array([q @ key[group] for key in keys]) / np.sqrt(e)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                heads.append(sum(w * v[group] for w, v in zip(weights, values)))
            x = x + lw["wo"] @ np.concatenate(heads)
            z = np_rms(x, lw["mlp_norm"])
            gate = lw["w_gate"] @ z
            x = x + lw["w_down"] @ (gate / (1 + np.exp(-gate)) * (lw["w_up"] @ z))
            new_slots.append(x)
        slots = new_slots
    return [np_rms(x, p["final_norm"]) for x in slots[1:]]


def np_slot(p, target, hidden, prev):
    m = p["markov_in"] @ target["embed"][prev]
    logits = target["lm_head"] @ hidden + p["markov_out"] @ m
    confidence = 1 / (1 + np.exp(-(p["confidence"] @ np.concatenate([hidden, m]) + p["confidence_bias"][0])))
    return logits, confidence


@pytest.fixture(scope="module")
def drafter():
    params = random_weights(dspark.weight_specs(DRAFT), seed=2)  # norms, biases, zeros all perturbed
    rng = np.random.default_rng(3)
    target = {"embed": jnp.asarray(rng.standard_normal((DRAFT.vocab_size, DRAFT.hidden_size)), jnp.float32),
              "lm_head": jnp.asarray(rng.standard_normal((DRAFT.vocab_size, DRAFT.hidden_size)) * 0.5, jnp.float32)}
    b, c = 2, 9
    features = rng.standard_normal((b, c, len(DRAFT.target_layers) * DRAFT.hidden_size)).astype(np.float32)
    ctx_positions = np.tile(np.arange(c), (b, 1)).astype(np.int32)
    ctx_positions[1, 6:] = -1  # row 1 has a shorter context (padding)
    numpy = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float64), tree)  # noqa: E731
    kv = jax.jit(lambda params, features, positions: dspark.context_kv(
        params, DRAFT, dspark.project_context(params, DRAFT, features), positions))(
        params, jnp.asarray(features), jnp.asarray(ctx_positions))
    return params, target, features, ctx_positions, kv, numpy(params), numpy(target)


def test_teacher_forced_forward_matches_numpy(drafter):
    params, target, features, ctx_positions, kv, p, t = drafter
    rng = np.random.default_rng(4)
    k = DRAFT.block_size
    anchors = rng.integers(0, DRAFT.vocab_size, (2, 3)).astype(np.int32)
    anchor_positions = np.array([[2, 5, 9], [0, 4, 8]], np.int32)  # blocks see contexts of different lengths
    prev = rng.integers(0, DRAFT.vocab_size, (2, 3, k)).astype(np.int32)
    logits, confidence = jax.jit(dspark.teacher_forced, static_argnums=1)(
        params, DRAFT, target, kv, jnp.asarray(ctx_positions), jnp.asarray(anchors), jnp.asarray(anchor_positions),
        jnp.asarray(prev))
    for row in range(2):
        for block in range(3):
            hidden = np_block(p, t, features[row].astype(np.float64), ctx_positions[row], anchors[row, block],
                              anchor_positions[row, block])
            for j in range(k):
                expect_logits, expect_conf = np_slot(p, t, hidden[j], prev[row, block, j])
                np.testing.assert_allclose(logits[row, block, j], expect_logits, rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(confidence[row, block, j], expect_conf, rtol=1e-4, atol=1e-5)


def test_propose_drafts_left_to_right_and_sends_the_confident_prefix(drafter):
    params, target, features, ctx_positions, kv, p, t = drafter
    anchors, anchor_positions = np.array([7, 30], np.int32), np.array([9, 6], np.int32)
    proposal = jax.jit(dspark.propose, static_argnames=("cfg",))(
        params, cfg=DRAFT, target_weights=target, ctx_kv=kv, ctx_positions=jnp.asarray(ctx_positions),
        anchor_tokens=jnp.asarray(anchors), anchor_positions=jnp.asarray(anchor_positions), threshold=0.3)
    assert proposal.draft_probs is None
    for row in range(2):
        hidden = np_block(p, t, features[row].astype(np.float64), ctx_positions[row], anchors[row],
                          anchor_positions[row])
        prev, survival, sent = anchors[row], 1.0, 0
        for j in range(DRAFT.block_size):  # the Markov head reads the previous draft
            logits, conf = np_slot(p, t, hidden[j], prev)
            prev = int(np.argmax(logits))
            assert proposal.tokens[row, j] == prev
            np.testing.assert_allclose(proposal.confidence[row, j], conf, rtol=1e-4)
            survival *= conf
            sent += survival >= 0.3 and sent == j
        assert proposal.num_drafts[row] == sent


def test_num_to_verify_keeps_the_prefix_whose_survival_clears_the_threshold():
    rng = np.random.default_rng(5)
    confidence = rng.random((300, 5)) ** 0.3
    threshold = rng.random(300)[:, None] * 0.9
    got = np.asarray(dspark.num_to_verify(jnp.asarray(confidence), jnp.asarray(threshold)))
    for row in range(300):
        n, survival = 0, 1.0
        while n < 5 and survival * confidence[row, n] >= threshold[row, 0]:
            survival *= confidence[row, n]
            n += 1
        assert got[row] == n
    assert len(set(got.tolist())) == 6


@pytest.mark.slow
def test_sampled_drafts_come_with_their_distribution(drafter):
    from weld.engine.sampler import SamplingArrays

    params, target, features, ctx_positions, kv, _, _ = drafter
    sampling = SamplingArrays(jnp.array([1.0, 0.0]), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2),
                              jnp.zeros(2, jnp.uint32), jnp.array([3, 4], jnp.uint32), jnp.zeros(2, jnp.int32))
    propose = jax.jit(dspark.propose, static_argnums=1)
    proposal = propose(params, DRAFT, target, kv, jnp.asarray(ctx_positions), jnp.array([7, 30]), jnp.array([9, 6]),
                       sampling, 0.0)
    assert proposal.draft_probs.shape == (2, DRAFT.block_size, DRAFT.vocab_size)
    np.testing.assert_allclose(proposal.draft_probs.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.take_along_axis(np.asarray(proposal.draft_probs), np.asarray(proposal.tokens)[..., None], -1) > 0)
    np.testing.assert_array_equal(proposal.num_drafts, DRAFT.block_size)
    sampling.temperature = jnp.zeros(2)  # every row greedy: the drafts are propose's greedy ones
    greedy = propose(params, DRAFT, target, kv, jnp.asarray(ctx_positions), jnp.array([7, 30]), jnp.array([9, 6]),
                     sampling, 0.0)
    np.testing.assert_array_equal(proposal.tokens[1], greedy.tokens[1])  # temperature 0: argmax
    assert not np.array_equal(proposal.tokens[0], greedy.tokens[0])  # row 0 sampled


def test_checkpoint_round_trip_and_loud_failures(tmp_path):
    params = random_weights(dspark.weight_specs(DRAFT), seed=6)
    dspark.save(tmp_path / "d", params, DRAFT, metadata={"note": "test"})
    loaded, cfg = dspark.load(tmp_path / "d")
    assert cfg == DRAFT

    def stored(x):  # matrices as Q8_0 blocks, vectors as f16
        x = np.asarray(x, np.float32)
        return quant.q8_0_values(*quant.q8_0(x)) if x.ndim == 2 else x.astype(np.float16).astype(np.float32)

    for (a, b) in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(stored(a), b)
    # arrays in another memory order (as a TPU's can reach the host) are saved as they read
    fortran = jax.tree.map(lambda x: np.asfortranarray(np.asarray(x)), params)
    assert any(not x.flags.c_contiguous for x in jax.tree.leaves(fortran))
    dspark.save(tmp_path / "f", fortran, DRAFT)
    for (a, b) in zip(jax.tree.leaves(params), jax.tree.leaves(dspark.load(tmp_path / "f")[0])):
        np.testing.assert_array_equal(stored(a), b)
    small = dataclasses.replace(DRAFT, draft_vocab_size=5)
    vocab = jnp.asarray([1, 4, 9, 16, 25], jnp.int32)
    dspark.save(tmp_path / "v", {**random_weights(dspark.weight_specs(small)), "draft_vocab": vocab}, small)
    assert np.array_equal(dspark.load(tmp_path / "v")[0]["draft_vocab"], vocab)
    dspark.save(tmp_path / "w", {**random_weights(dspark.weight_specs(small)), "draft_vocab": vocab[::-1]}, small)
    with pytest.raises(ValueError, match="ascending"):
        dspark.load(tmp_path / "w")
    other = dataclasses.replace(DRAFT, markov_rank=7)
    dspark.save(tmp_path / "bad", random_weights(dspark.weight_specs(other)), other)
    config = (tmp_path / "d" / "config.json").read_text()
    (tmp_path / "bad" / "config.json").write_text(config)  # config says rank 5, tensors have 7
    with pytest.raises(ValueError, match="markov"):
        dspark.load(tmp_path / "bad")
    with pytest.raises(ValueError, match="num_layers=3"):
        cfg.check_target(llama.Config(architecture="llama", vocab_size=40, hidden_size=16, intermediate_size=8,
                                      num_layers=4, num_heads=2, num_kv_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="target_layers"):
        dataclasses.replace(DRAFT, target_layers=(0, 3))


def test_a_drafter_stores_its_matrices_as_the_cpu_runs_them_and_older_files_still_load(tmp_path):
    """Version 2 keeps each matrix as Q8_0 blocks (int8 codes + f16 scales: ~1.06 bytes a
    weight, against 2 for f16), which is what the CPU's kernels run (`quantized`): reading the file
    back and quantizing again gives the same codes and scales, so a saved drafter drafts on the
    CPU exactly as the one in memory did. Version 1 files (f16, the shipped drafter's) still load;
    codes without scales, or scales of the wrong shape, are refused."""
    from safetensors.numpy import load_file, save_file

    params = random_weights(dspark.weight_specs(DRAFT), seed=8)
    dspark.save(tmp_path / "d", params, DRAFT)
    on_file = load_file(str(tmp_path / "d" / dspark.WEIGHTS_FILE))
    matrices = [k for k in on_file if k + dspark.SCALES in on_file]
    assert matrices and all(on_file[k].dtype == np.int8 for k in matrices)
    loaded = dspark.load(tmp_path / "d")[0]
    for a, b in zip(jax.tree.leaves(dspark.quantized(params), is_leaf=quant.is_quantized),
                    jax.tree.leaves(dspark.quantized(loaded), is_leaf=quant.is_quantized)):
        if quant.is_quantized(a):
            np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
            np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
    # version 1: every tensor f16
    v1 = tmp_path / "v1"
    v1.mkdir()
    names = [k for k in on_file if not k.endswith(dspark.SCALES)]
    flat = {dspark.path_str(path): np.asarray(dspark._leaf(params, path), np.float16)
            for path, _ in dspark.iter_specs(dspark.weight_specs(DRAFT))}
    assert sorted(flat) == sorted(names)
    save_file(flat, str(v1 / dspark.WEIGHTS_FILE))
    document = json.loads((tmp_path / "d" / "config.json").read_text())
    (v1 / "config.json").write_text(json.dumps({**document, "version": 1}))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(dspark.load(v1)[0])):
        np.testing.assert_array_equal(np.asarray(a, np.float16).astype(np.float32), b)
    # a matrix's scales missing, or of another shape
    broken = dict(on_file)
    del broken[matrices[0] + dspark.SCALES]
    save_file(broken, str(tmp_path / "d" / dspark.WEIGHTS_FILE))
    with pytest.raises(ValueError, match="missing tensors"):
        dspark.load(tmp_path / "d")
    broken = {**on_file, matrices[0] + dspark.SCALES: on_file[matrices[0] + dspark.SCALES][:, :0]}
    save_file(broken, str(tmp_path / "d" / dspark.WEIGHTS_FILE))
    with pytest.raises(ValueError, match="Q8_0 blocks"):
        dspark.load(tmp_path / "d")
