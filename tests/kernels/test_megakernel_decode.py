"""The whole decode megakernel against the XLA path (`weld.models.llama.forward`), in Pallas TPU
interpret mode: tiny dense configs of 2 to 4 layers, batch 1 and 4, KV pages scattered through
the pool, several steps crossing page boundaries, the verify block, int8 weights, planted bugs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpret_mode import races_found

from weld.kernels.megakernel import decode as mk
from weld.kernels.megakernel.plan import VmemBudgetError
from weld.models import FAMILIES, gemma3, llama
from weld.models import megakernel
from weld.models.common.cache import AttentionBatch
from weld.models.common.rope import Rope, RopeScaling
from weld.models.common import quant
from weld.models.common.spec import abstract_weights, map_specs, random_weights
from weld.models.family import WeightTarget

PAGE = 4
# every row's pages are scattered over the pool, out of order
BLOCK_TABLES = np.array([[9, 2, 14, 5, 11], [3, 12, 0, 7, 16], [13, 1, 8, 6, 15], [4, 10, 17, 18, 19]], np.int32)
NUM_PAGES = 20
# small tiles: every matrix is several tiles, the ring wraps inside and across matrices and layers
OPTIONS = megakernel.KernelOptions(tile_rows=16, vocab_tile_rows=32, ring_depth=3, pages_per_kv_tile=2)

# the LM head [128, 32] and gate / up [128, 32] are stored column-major on a TPU and stream from
# their transposes (`plan.stored_transposed`), beside row-major q / k / v / o / down
LLAMA = llama.Config(architecture="llama", vocab_size=128, hidden_size=32, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                     rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=16))
# Qwen3 switches plus Qwen2's qkv bias, an o bias, tied embeddings, head dim 64, GQA 4:1
QWEN = llama.Config(architecture="qwen3", vocab_size=80, hidden_size=48, intermediate_size=40, num_layers=3,
                    num_heads=4, num_kv_heads=1, head_dim=64, qk_norm=True, qkv_bias=True, o_bias=True,
                    tie_word_embeddings=True, rope_theta=1e6)


def _family(cfg):
    """The model family of a config (its module in the registry)."""
    return next(family for family in FAMILIES if isinstance(cfg, family.Config))


def _setup(cfg, batch, seed=0, adjust=None):
    """Weights (`adjust(weights, rng)` may change them first), and a cache holding each row's
    prompt (written by the XLA path)."""
    weights = random_weights(_family(cfg).weight_specs(cfg), seed=seed)
    rng = np.random.default_rng(seed)
    if adjust is not None:
        adjust(weights, rng)
    prompt_lens = [2, 5, 3, 7][:batch]  # steps from here cross page boundaries at 4 and 8
    tokens = np.zeros((batch, max(prompt_lens)), np.int32)
    positions = np.full(tokens.shape, -1, np.int32)
    for i, n in enumerate(prompt_lens):
        tokens[i, :n] = rng.integers(0, cfg.vocab_size, n)
        positions[i, :n] = np.arange(n)
    cache_spec = _family(cfg).cache_spec(cfg)
    cache = cache_spec.create(NUM_PAGES, PAGE, jnp.float32, num_slots=len(BLOCK_TABLES))
    bt = cache_spec.tables(jnp.asarray(BLOCK_TABLES[:batch]))  # every page group's pool: the same page ids
    logits, _, cache = _xla_step(cfg)(weights, jnp.asarray(tokens), jnp.asarray(positions), cache, bt)
    last = jnp.asarray(np.array(prompt_lens) - 1)
    first = jnp.argmax(jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], axis=-1).astype(jnp.int32)
    return weights, cache, bt, first, jnp.asarray(prompt_lens, jnp.int32)


@functools.lru_cache(maxsize=None)
def _xla_step(cfg):
    forward = _family(cfg).forward
    return jax.jit(lambda w, tok, pos, cache, bt: forward(w, cfg, tok, pos, cache, AttentionBatch(bt)))


@functools.lru_cache(maxsize=None)
def _kernel_step(cfg, options):
    """One jitted kernel step per (config, options): tests with the same shapes share its compile."""
    return jax.jit(lambda w, tok, pos, cache, bt: megakernel.forward(w, cfg, tok, pos, cache, AttentionBatch(bt),
                                                                     options=options))


def _rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def _greedy_run(cfg, batch, steps, interpret, *, padding_row=False, options=OPTIONS, ref_weights=None, adjust=None):
    """Both paths decode `steps` greedy tokens from the same prompts, each on its own cache."""
    weights, cache, bt, tok, pos = _setup(cfg, batch, adjust=adjust)
    ref_weights = weights if ref_weights is None else ref_weights
    xla, kernel = _xla_step(cfg), _kernel_step(cfg, dataclasses.replace(options, interpret=interpret))
    live = np.ones(batch, bool)
    if padding_row:
        live[-1] = False
    feed_pos = jnp.where(jnp.asarray(live), pos, -1)
    ref_cache, ref_tok, errors = cache, tok, []
    for _ in range(steps):
        ref_logits, _, ref_cache = xla(ref_weights, ref_tok[:, None], feed_pos[:, None], ref_cache, bt)
        logits, _, cache = kernel(weights, tok[:, None], feed_pos[:, None], cache, bt)
        errors.append(_rel_err(logits[live], ref_logits[live]))
        ref_tok = jnp.argmax(ref_logits[:, 0], axis=-1).astype(jnp.int32)
        tok = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        np.testing.assert_array_equal(np.asarray(tok)[live], np.asarray(ref_tok)[live])
        feed_pos = jnp.where(jnp.asarray(live), feed_pos + 1, -1)
    return errors, cache, ref_cache


def _assert_caches_close(cache, ref_cache, tol=1e-5):
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_llama_batch1_four_steps_match_xla(interpret):
    """2 layers, llama3 rope, untied head, batch 1: positions 2..5 cross the page boundary at 4."""
    errors, cache, ref_cache = _greedy_run(LLAMA, batch=1, steps=4, interpret=interpret)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


@pytest.mark.slow
def test_qwen_batch4_six_steps_match_xla(interpret):
    """3 layers, q/k norm, qkv and o biases, tied, head dim 64, batch 4 with a padding row."""
    errors, cache, ref_cache = _greedy_run(QWEN, batch=4, steps=6, interpret=interpret, padding_row=True)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


@pytest.mark.slow
def test_four_layers_batch4_deep_ring_match_xla(interpret):
    cfg = dataclasses.replace(LLAMA, num_layers=4)
    options = dataclasses.replace(OPTIONS, tile_rows=8, ring_depth=4, pages_per_kv_tile=1)
    errors, cache, ref_cache = _greedy_run(cfg, batch=4, steps=4, interpret=interpret, options=options)
    assert max(errors) < 1e-3, errors
    _assert_caches_close(cache, ref_cache)
    assert not races_found()


def _verify_block(cfg, batch, interpret, setup=_setup, step_tol=1e-6):
    """k + 1 = 3 tokens per row, causal within the block: the same logits and pools as three
    one-token steps of the kernel (within step_tol), and as the XLA path fed the same block."""
    weights, cache, bt, _, pos = setup(cfg, batch, seed=1)
    block = jnp.asarray([[5, 17, 40], [63, 2, 11]][:batch], jnp.int32)
    positions = pos[:, None] + jnp.arange(3)[None]  # row 0: 2, 3, 4 crosses a page; row 1: 5, 6, 7
    options = dataclasses.replace(OPTIONS, interpret=interpret)
    block_logits, _, block_cache = _kernel_step(cfg, options)(weights, block, positions, cache, bt)
    assert block_logits.shape == (batch, 3, cfg.vocab_size)
    step_cache = cache
    for j in range(3):
        logits, _, step_cache = _kernel_step(cfg, options)(weights, block[:, j:j + 1], positions[:, j:j + 1],
                                                           step_cache, bt)
        assert _rel_err(block_logits[:, j], logits[:, 0]) < 1e-4
    _assert_caches_close(block_cache, step_cache, tol=step_tol)
    ref_logits, _, ref_cache = _xla_step(cfg)(weights, block, positions, cache, bt)
    assert _rel_err(block_logits, ref_logits) < 1e-3
    _assert_caches_close(block_cache, ref_cache)
    assert not races_found()


def test_verify_block_matches_single_steps_and_xla(interpret):
    _verify_block(LLAMA, 1, interpret)


@pytest.mark.slow
def test_verify_block_qwen_batch2(interpret):
    _verify_block(QWEN, 2, interpret)


# Gemma 3: sandwich norms, GELU-tanh, the scaled embedding, sliding layers (window 3) with their
# own RoPE base beside a full layer with linearly scaled RoPE (two page groups), soft-capped logits
GEMMA = gemma3.Config(architecture="gemma3_text", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, layer_types=(gemma3.SLIDING, gemma3.FULL, gemma3.SLIDING),
                      sliding_window=3, rope_global=Rope(16, 1e6, RopeScaling(kind="linear", factor=2.0), 64),
                      rope_local=Rope(16, 1e4, RopeScaling(), 64), query_pre_attn_scalar=24.0,
                      final_logit_softcapping=3.0)
# Mistral: every layer slides (one page group, windowed)
MISTRAL = dataclasses.replace(LLAMA, architecture="mistral", sliding_window=3, rope_scaling=RopeScaling())
WINDOW_OPTIONS = dataclasses.replace(OPTIONS, pages_per_kv_tile=1)  # tiles of 4 tokens: windows skip tiles


def _random_norms(weights, rng):
    """Norm weights away from their init, each its own (a swapped or missing norm shows)."""
    for lw in weights["layers"]:
        for name in [n for n in lw if n.endswith("norm")]:
            lw[name] = jnp.asarray(rng.normal(0.0, 0.3, lw[name].shape), lw[name].dtype)


@pytest.mark.parametrize("cfg,bug", [(GEMMA, None), pytest.param(MISTRAL, None, marks=pytest.mark.slow),
                                     (GEMMA, "full_window")], ids=["gemma3", "mistral", "gemma3-full-window"])
def test_sliding_windows_and_gemma3_match_xla(interpret, cfg, bug):
    """Batch 4 with a padding row, 5 steps: rows reach positions 11, whose windows start past
    whole tiles (skipped). Logits within 1e-3 and the XLA path's greedy tokens; a kernel that
    attends past the window ("full_window") is caught."""
    options = dataclasses.replace(WINDOW_OPTIONS, interpret=interpret)
    if bug is None:
        errors, cache, ref_cache = _greedy_run(cfg, batch=4, steps=5, interpret=interpret, padding_row=True,
                                               options=options, adjust=_random_norms)
        assert max(errors) < 1e-3, errors
        _assert_caches_close(cache, ref_cache)
        assert not races_found()
        return
    weights, cache, bt, tok, pos = _setup(cfg, 4, adjust=_random_norms)
    step = jax.jit(lambda w, t, p, c, b: mk.decode_step(
        megakernel.spec_for(cfg, batch=4, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32,
                            pages_per_kv_tile=1), megakernel.kernel_params(cfg, w), t, p, b,
        [layer.k for layer in c.layers], [layer.v for layer in c.layers], tile_rows=16, vocab_tile_rows=32,
        ring_depth=3, interpret=interpret, _bug=bug)[0])
    ref_logits, _, _ = _xla_step(cfg)(weights, tok[:, None], pos[:, None], cache, bt)
    logits = step(weights, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(logits, ref_logits) > 1e-2


def test_gemma3_verify_block(interpret):
    """The verify block on Gemma 3: a window boundary inside the block."""
    _verify_block(GEMMA, 2, interpret, setup=functools.partial(_setup, adjust=_random_norms))


def _quantized(weights, cfg, mode="int8_channel"):
    """The tree as loaded with `quantization=mode` (what the declaration marks, by
    `weld.weights.tree.finished`'s rule), prepared for the megakernel."""
    family = _family(cfg)
    out = map_specs(lambda path, spec: _leaf(weights, path, spec, mode), family.weight_specs(cfg))
    return family.prepare_weights(out, cfg, WeightTarget(backend="megakernel"))


def _leaf(weights, path, spec, mode):
    value = weights
    for key in path:
        value = value[key]
    mode = quant.leaf_mode(spec.quantize, mode)
    return quant.quantize_any(np.asarray(value, np.float32), mode) if mode else value


def _dequantized(quantized):
    """The same tree with every quantized matrix replaced by its float values."""
    return jax.tree_util.tree_map(lambda w: w.unpacked() if quant.is_quantized(w) else w, quantized,
                                  is_leaf=quant.is_quantized)


@pytest.mark.parametrize("cfg", [LLAMA, QWEN], ids=["llama", "qwen-tied"])
def test_int8_weights_match_xla_on_dequantized_weights(interpret, cfg):
    """int8 matrices with per-output-channel scales, quantized once at load and streamed with their
    scales (a tied embedding as the LM head too, looked up in its float copy): equal to the XLA
    path run on the dequantized weights, and not equal to the f32 model (quantization happened)."""
    quantized = _int8_matches_xla(cfg, interpret)
    assert quant.is_quantized(quantized["layers"][0]["wq"]) and quantized["layers"][0]["wq"].fmt == "int8_channel"


def _int8_matches_xla(cfg, interpret, setup=_setup, mode="int8_channel", batch=1):
    """The kernel on the tree quantized at load (`mode`) equals the XLA path on its dequantized
    values (and on the quantized tree itself), and differs from the float model. Returns the
    quantized tree."""
    weights, cache, bt, tok, pos = setup(cfg, batch=batch, seed=2)
    quantized = _quantized(weights, cfg, mode)
    options = dataclasses.replace(OPTIONS, interpret=interpret)
    logits, _, k_cache = _kernel_step(cfg, options)(quantized, tok[:, None], pos[:, None], cache, bt)
    ref, _, ref_cache = _xla_step(cfg)(_dequantized(quantized), tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(logits, ref) < 1e-3
    _assert_caches_close(k_cache, ref_cache)
    # the XLA path takes the quantized tree as it is (int8 codes into the matmul, scales after)
    direct, _, _ = _xla_step(cfg)(quantized, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(direct, ref) < 1e-4
    full, _, _ = _xla_step(cfg)(weights, tok[:, None], pos[:, None], cache, bt)
    assert _rel_err(logits, full) > 1e-4
    assert not races_found()
    return quantized


def test_int8_round_trip_by_hand():
    """Row [1, -2, 0.5]: scale 2/127; q = round(w / scale) = [64, -127, 32]."""
    m = quant.quantize(np.asarray([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]), "int8_channel")
    np.testing.assert_array_equal(np.asarray(m.codes), [[64, -127, 32], [0, 0, 0]])
    np.testing.assert_allclose(np.asarray(m.scales), [2 / 127, 1.0], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(m.unpacked()), [[64 * 2 / 127, -2.0, 32 * 2 / 127], [0, 0, 0]], rtol=1e-6)


@pytest.mark.parametrize("bug", [pytest.param(None, marks=pytest.mark.slow), "wrong_slot",
                                 pytest.param("skip_wait", marks=pytest.mark.slow)])
def test_planted_stream_bug_is_caught(interpret, bug):
    """The whole-kernel check can fail: a missing wait or a wrong ring slot in the weight stream
    gives wrong logits (NaN or another tile's weights). Without a bug (the control) the same call
    matches, and its greedy ids are the argmax of the XLA logits."""
    cfg = LLAMA
    weights, cache, bt, tok, pos = _setup(cfg, batch=1)
    spec = megakernel.spec_for(cfg, batch=1, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32,
                               pages_per_kv_tile=2)
    logits, ids, *_ = mk.decode_step(spec, megakernel.kernel_params(cfg, weights), tok[:, None], pos[:, None], bt,
                                       [p.k for p in cache.layers], [p.v for p in cache.layers], tile_rows=16, vocab_tile_rows=32, ring_depth=3,
                                       interpret=interpret, _bug=bug)
    ref, _, _ = _xla_step(cfg)(weights, tok[:, None], pos[:, None], cache, bt)
    if bug is None:
        assert _rel_err(logits, ref) < 1e-3
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(jnp.argmax(ref, axis=-1)))
        assert not races_found()
    else:
        assert not np.allclose(np.asarray(logits), np.asarray(ref), rtol=1e-3, atol=1e-3)


def test_vmem_budget_checked_before_compiling():
    """A Llama-3-8B-sized step whose tiles cannot fit v7's VMEM fails with both numbers while the
    call is traced (abstract weights: nothing is allocated or compiled). The fitting case and the
    ring fallback are tested on the plan itself (test_megakernel_plan.py)."""
    cfg = dataclasses.replace(LLAMA, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                              head_dim=128, vocab_size=128256, num_layers=2)  # 8B's layers, two of them
    spec = megakernel.spec_for(cfg, batch=1, page_size=16, weight_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    weights = abstract_weights(llama.weight_specs(cfg), jnp.bfloat16)
    pools = [jax.ShapeDtypeStruct((4, 16, 8 * 128), jnp.bfloat16)] * cfg.num_layers
    ids, bt = jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1, 8), jnp.int32)

    def step(w, tok, pos, bt, k, v, **kw):
        return mk.decode_step(spec, megakernel.kernel_params(cfg, w), tok, pos, bt, k, v, interpret=True, **kw)

    with pytest.raises(VmemBudgetError, match=r"needs \d+ B of VMEM .* but v7 allows \d+ B"):
        jax.eval_shape(lambda *a: step(*a, tile_rows=4096, generation="v7"), weights, ids, ids, bt, pools, pools)


def test_validation_names_both_values():
    cfg = LLAMA
    weights, cache, bt, tok, pos = _setup(cfg, batch=1)
    spec = megakernel.spec_for(cfg, batch=2, page_size=PAGE, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
    params = megakernel.kernel_params(cfg, weights)
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\] = \(2, 1\) .* got \(1, 1\)"):
        mk.decode_step(spec, params, tok[:, None], pos[:, None], bt, [p.k for p in cache.layers], [p.v for p in cache.layers])
    spec = dataclasses.replace(spec, batch=1)
    bad = dict(params, layers=[dict(params["layers"][0], k=jnp.zeros((8, 33)))] + params["layers"][1:])
    with pytest.raises(ValueError, match=r"layers\[0\]\['k'\] must be \[out, in\] = \(16, 32\), got \(8, 33\)"):
        mk.decode_step(spec, bad, tok[:, None], pos[:, None], bt, [p.k for p in cache.layers], [p.v for p in cache.layers])
    with pytest.raises(ValueError, match=r"block_tables must be \[B, page_groups x max_pages\] with B = 1 and 2 page "
                                         r"groups, got \(1, 5\)"):
        mk.decode_step(dataclasses.replace(spec, page_groups=2, layer_groups=(0, 1)), params, tok[:, None],
                       pos[:, None], bt, [p.k for p in cache.layers], [p.v for p in cache.layers])
    with pytest.raises(ValueError, match=r"layer_windows must be empty or one int per layer \(2\)"):
        dataclasses.replace(spec, layer_windows=(4,))
