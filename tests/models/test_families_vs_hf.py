"""Every family against HF transformers: prefill and paged decode logits, batching on scattered pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.conftest import FAMILY_VARIANTS
from weld.models.common.cache import AttentionBatch
from weld.weights import ModelSource, load_model

FAMILIES = FAMILY_VARIANTS
PAGE = 4


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@functools.lru_cache(maxsize=None)
def jitted_forward(forward):
    return jax.jit(forward, static_argnums=(1,))


def run(loaded, cache, ids, positions, block_tables):
    tokens = jnp.asarray(ids, jnp.int32)
    pos = jnp.asarray(positions, jnp.int32)
    logits, _, cache = jitted_forward(loaded.family.forward)(
        loaded.weights, loaded.cfg, tokens, pos, cache,
        AttentionBatch(loaded.family.cache_spec(loaded.cfg).tables(jnp.asarray(block_tables, jnp.int32))))
    return np.asarray(logits), cache


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tiny_model_dir):
    directory, hf_model = tiny_model_dir(request.param)
    loaded = load_model(ModelSource("hf", directory, request.param), dtype="float32")
    return request.param, loaded, hf_model


def test_prefill_then_paged_decode_match_hf(family_case):
    name, loaded, hf_model = family_case
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, loaded.cfg.vocab_size, 11).tolist()
    steps = 9
    full = prompt + rng.integers(0, loaded.cfg.vocab_size, steps).tolist()
    ref = hf_logits(hf_model, full)

    cache = loaded.family.cache_spec(loaded.cfg).create(num_pages=32, page_size=PAGE, dtype=jnp.float32, num_slots=4)
    table = [[17, 3, 29, 8, 21, 0]]  # deliberately scattered, unordered pages
    logits, cache = run(loaded, cache, [prompt], [list(range(len(prompt)))], table)
    np.testing.assert_allclose(logits[0], ref[:len(prompt)], atol=1e-4, rtol=0)
    for step in range(steps):  # one token at a time, crossing page boundaries
        pos = len(prompt) + step
        logits, cache = run(loaded, cache, [[full[pos]]], [[pos]], table)
        np.testing.assert_allclose(logits[0, 0], ref[pos], atol=1e-4, rtol=0,
                                   err_msg=f"{name} decode step {step}")


def test_batched_prefill_and_decode_equal_single(family_case):
    """Three prompts of different lengths on scattered pages, with padding, equal each alone."""
    name, loaded, hf_model = family_case
    rng = np.random.default_rng(2)
    lengths = [5, 13, 9]
    prompts = [rng.integers(0, loaded.cfg.vocab_size, n).tolist() for n in lengths]
    tables = [[30, 2, 11, 7], [5, 19, 1, 26], [14, 9, 23, 4]]
    t = max(lengths)
    tokens = [p + [0] * (t - len(p)) for p in prompts]
    positions = [list(range(len(p))) + [-1] * (t - len(p)) for p in prompts]
    cache = loaded.family.cache_spec(loaded.cfg).create(num_pages=32, page_size=PAGE, dtype=jnp.float32, num_slots=4)
    logits, cache = run(loaded, cache, tokens, positions, tables)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i, :len(p)], hf_logits(hf_model, p), atol=1e-4, rtol=0)
    # One decode step for all three at once.
    nxt = [int(logits[i, len(p) - 1].argmax()) for i, p in enumerate(prompts)]
    logits, cache = run(loaded, cache, [[x] for x in nxt], [[n] for n in lengths], tables)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i, 0], hf_logits(hf_model, p + [nxt[i]])[-1], atol=1e-4, rtol=0)


def test_padding_rows_write_nothing(family_case):
    """A padded token (position -1) must leave every page untouched."""
    _, loaded, _ = family_case
    cache = loaded.family.cache_spec(loaded.cfg).create(num_pages=8, page_size=PAGE, dtype=jnp.float32, num_slots=4)
    _, cache = run(loaded, cache, [[1, 2, 3]], [[-1, -1, -1]], [[0, 1]])
    assert all(float(jnp.abs(k).max()) == 0.0 for k in jax.tree.leaves(cache))


def test_bfloat16_close_to_float32(tiny_model_dir):
    directory, hf_model = tiny_model_dir("llama")
    f32 = load_model(ModelSource("hf", directory, "llama"), dtype="float32")
    bf16 = load_model(ModelSource("hf", directory, "llama"), dtype="bfloat16")
    assert bf16.weights["layers"][0]["wq"].dtype == jnp.bfloat16
    ids = [[3, 14, 15, 92, 65, 35, 89, 79]]
    pos = [list(range(8))]
    outs = []
    for loaded, dtype in ((f32, jnp.float32), (bf16, jnp.bfloat16)):
        cache = loaded.family.cache_spec(loaded.cfg).create(4, PAGE, dtype)
        logits, _ = run(loaded, cache, ids, pos, [[2, 0]])
        assert logits.dtype == np.float32
        outs.append(logits)
    scale = np.abs(outs[0]).max()
    assert np.abs(outs[0] - outs[1]).max() < 0.05 * scale
    assert np.abs(outs[0] - outs[1]).max() > 0  # bf16 really ran in bf16
