"""The KV pool as users size it: by default what max_num_seqs sequences of max_model_len tokens
need (at most DEFAULT_KV_CACHE_GB), or kv_cache_memory_gb / num_pages; and kv_cache_dtype, which
halves a float32 pool with float16 or bfloat16 while greedy text stays the float32 pool's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld import LLM, SamplingParams
from weld.config import DEFAULT_KV_CACHE_GB

PAGE, CONTEXT = 4, 64
PER_SEQ = CONTEXT // PAGE + 1  # a sequence's pages, plus one for the decode call's steps ahead


@pytest.fixture(scope="module")
def model_dir(tiny_family_dir):
    return str(tiny_family_dir("llama")[0])


def engine(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=CONTEXT, page_size=PAGE, progress=False, **kwargs)


def pool_bytes(llm: LLM) -> int:
    return sum(x.nbytes for layer in llm.engine.runner.cache.layers for x in (layer.k, layer.v))


def test_the_default_pool_holds_max_num_seqs_sequences(model_dir):
    for seqs in (1, 3):
        llm = engine(model_dir, max_num_seqs=seqs)
        assert llm.engine.stats()["num_pages"] == seqs * PER_SEQ
        assert pool_bytes(llm) < DEFAULT_KV_CACHE_GB * (1 << 30)


def test_a_memory_budget_caps_the_pool_and_fits_one_sequence(model_dir):
    big = engine(model_dir, max_num_seqs=8)
    per_page = pool_bytes(big) // big.engine.stats()["num_pages"]
    budget = 20 * PER_SEQ * per_page  # room for 20 sequences: more than max_num_seqs, the budget rules
    assert engine(model_dir, max_num_seqs=8, kv_cache_memory_gb=budget / (1 << 30)).engine.stats()["num_pages"] == \
        20 * PER_SEQ
    tiny = engine(model_dir, max_num_seqs=8, kv_cache_memory_gb=1e-9)
    assert tiny.engine.stats()["num_pages"] == PER_SEQ  # one sequence of max_model_len always fits


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16_bit_pool_halves_the_bytes_and_keeps_the_text(model_dir, kv_dtype):
    budget = dict(max_num_seqs=4, kv_cache_memory_gb=0.0005)
    f32, half = engine(model_dir, **budget), engine(model_dir, kv_cache_dtype=kv_dtype, **budget)
    assert half.engine.runner.cache.layers[0].k.dtype == np.dtype(kv_dtype)
    assert abs(half.engine.stats()["num_pages"] - 2 * f32.engine.stats()["num_pages"]) <= 1  # same bytes, 2x pages
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 7, 21, 8]}, {"prompt_token_ids": [11, 4, 30]}]
    want = f32.generate(prompts, params, use_tqdm=False)
    got = half.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = lambda o: np.array([next(iter(d.values())).logprob for d in o.outputs[0].logprobs])  # noqa: E731
        np.testing.assert_allclose(lp(b), lp(a), atol=0.05)
        assert not np.array_equal(lp(b), lp(a))  # the 16-bit pool really was read


def test_auto_is_float16_where_weld_chose_float32_and_the_dtype_given_otherwise(model_dir):
    """`resolve_kv_dtype`: with dtype auto on the CPU (float32 weights, weld's choice) the pool is
    float16, as llama.cpp keeps it; an explicit dtype is the pool's too (vLLM's 'auto')."""
    from weld.engine.llm import resolve_kv_dtype

    assert jax.default_backend() == "cpu"
    args = dict(max_model_len=CONTEXT, page_size=PAGE, progress=False, max_num_seqs=2)
    auto, f32 = LLM(model_dir, **args), engine(model_dir, max_num_seqs=2)
    assert auto.engine.runner.cache.layers[0].k.dtype == np.float16
    assert f32.engine.runner.cache.layers[0].k.dtype == np.float32
    assert pool_bytes(auto) * 2 == pool_bytes(f32)  # the same pages, half the bytes
    assert resolve_kv_dtype("auto", "bfloat16") == jnp.bfloat16
    assert resolve_kv_dtype("auto", None) == jnp.float16
    assert resolve_kv_dtype("float32", "auto") == jnp.float32  # asked for: kept
