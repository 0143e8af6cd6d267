"""Every family through the engine users get (`LLM`: fused and packed weights, native kernels,
the scheduler, paged caches of the family's kind), checked against HF transformers' greedy
generation on the same tiny random model: batched rows, prefix-cache hits, chunked prefill,
preemption, n > 1, structured outputs, n-gram and DSpark speculation."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ENGINE_VARIANTS
from weld import LLM, SamplingParams
from weld.engine.block_manager import BlockManager
from weld.engine.sampling_params import StructuredOutputsParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):", "Paris is the capital of France. Paris is"]
NEW_TOKENS = 10
ENGINE = dict(dtype="float32", max_model_len=96, page_size=4, kv_cache_memory_gb=0.004, max_num_seqs=4,
              steps_per_call=4)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=ENGINE_VARIANTS)
def case(request, tiny_family_dir):
    directory, hf = tiny_family_dir(request.param)
    llm = LLM(str(directory), **ENGINE)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy)
    return request.param, directory, llm, hf, [list(o.outputs[0].token_ids) for o in outs]


def assert_no_leaks(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages and not llm.engine.requests


def test_batched_greedy_equals_hf(case):
    variant, _, llm, hf, batched = case
    for prompt, tokens in zip(PROMPTS, batched):
        assert tokens == hf_greedy(hf, llm.tokenizer.encode(prompt), NEW_TOKENS), (variant, prompt)
    assert_no_leaks(llm)


def test_prefix_cache_hits_and_chunked_prefill_keep_outputs(case):
    _, _, llm, _, batched = case
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    hits = llm.engine.block_manager.prefix_hits
    again = llm.generate(PROMPTS, greedy)
    assert llm.engine.block_manager.prefix_hits > hits  # full pages of the first run were reused
    assert [list(o.outputs[0].token_ids) for o in again] == batched
    scheduler = llm.engine.scheduler
    budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, 5
    try:  # prompts in chunks of at most 5 tokens, mixed with the other rows' decode steps
        llm.engine.block_manager.enable_prefix_caching = False
        chunked = llm.generate(PROMPTS, greedy)
    finally:
        scheduler.max_num_batched_tokens = budget
        llm.engine.block_manager.enable_prefix_caching = True
    assert [list(o.outputs[0].token_ids) for o in chunked] == batched
    assert_no_leaks(llm)


def test_preemption_by_recompute_keeps_outputs(case):
    """A pool too small for the three rows at once: the newest is preempted and recomputed."""
    _, _, llm, _, batched = case
    scheduler = llm.engine.scheduler
    roomy = scheduler.block_manager
    windows = tuple(pool.window for pool in roomy.pools)
    # A full-context group holds the longest row, not all three; a window's group frees pages as it
    # goes, so when there is no full group (Mistral) it gets one row's window and a call ahead.
    needs = [-(-(len(llm.tokenizer.encode(p)) + NEW_TOKENS) // roomy.page_size) for p in PROMPTS]
    assert sum(needs) > max(needs) + 1
    sizes = [max(needs) + 1 if window is None else (max(needs) + 1 if None in windows else 5) for window in windows]
    scheduler.block_manager = BlockManager(sizes, roomy.page_size, False, windows=windows, num_slots=roomy.num_slots,
                                           num_snapshot_slots=roomy.num_snapshot_slots)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        assert scheduler.num_preemptions > 0
        assert [list(o.outputs[0].token_ids) for o in outs] == batched
        assert scheduler.block_manager.num_free_pages == scheduler.block_manager.num_pages
        assert scheduler.block_manager.num_free_slots == scheduler.block_manager.num_slots
    finally:  # a fresh manager like the first: the small one wrote over pages the first one has cached
        scheduler.block_manager = BlockManager([p.num_pages for p in roomy.pools], roomy.page_size,
                                               roomy.enable_prefix_caching, windows=windows, num_slots=roomy.num_slots,
                                               num_snapshot_slots=roomy.num_snapshot_slots,
                                               snapshot_interval=roomy.snapshot_interval)


def test_n_samples_and_structured_outputs(case):
    _, _, llm, _, _ = case
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7)
    first, second = (llm.generate(PROMPTS[1], params)[0] for _ in range(2))
    samples = [list(c.token_ids) for c in first.outputs]
    assert samples == [list(c.token_ids) for c in second.outputs]  # seeded: reproducible
    assert len(set(map(tuple, samples))) > 1  # three different completions of one prompt
    choice = SamplingParams(max_tokens=8, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    as_json = SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    picked, structured = llm.generate([PROMPTS[0], PROMPTS[2]], [choice, as_json])
    assert picked.outputs[0].text in ("yes", "no", "maybe")
    if structured.outputs[0].finish_reason == "stop":  # a tiny random model may run out of tokens first
        assert isinstance(json.loads(structured.outputs[0].text)["a"], int)
    assert_no_leaks(llm)


def test_ngram_speculation_equals_plain(case):
    variant, directory, llm, _, batched = case
    spec = LLM(str(directory), **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                 "adaptive": False})
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = spec.generate(PROMPTS, greedy)
    assert [list(o.outputs[0].token_ids) for o in outs] == batched, variant
    # A prompt that repeats itself and the model's own continuation, so the n-gram lookup drafts.
    ids = llm.tokenizer.encode(PROMPTS[2])
    echo = {"prompt_token_ids": ids + batched[2] + ids}
    plain, drafted = llm.generate(echo, greedy)[0], spec.generate(echo, greedy)[0]
    assert list(drafted.outputs[0].token_ids) == list(plain.outputs[0].token_ids), variant
    assert spec.engine.spec_stats()["spec_num_draft_tokens"] > 0
    assert_no_leaks(spec)


@pytest.fixture(scope="module")
def drafter_dir(case, tmp_path_factory):
    """An untrained DSpark drafter for this case's target (random Markov and confidence terms)."""
    import numpy as np

    from weld.engine.spec import dspark

    _, _, llm, _, _ = case
    cfg = dspark.DraftConfig.for_target(llm.cfg, block_size=3, target_layers=(0, llm.cfg.num_layers - 1),
                                        num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32, markov_rank=4)
    params = dspark.init_params(cfg, seed=1, target_weights=llm.model.weights)
    rng = np.random.default_rng(0)
    params["markov_out"] = params["markov_out"] + 0.3 * rng.standard_normal(params["markov_out"].shape)
    directory = tmp_path_factory.mktemp("dspark")
    dspark.save(directory, params, cfg)
    return directory


@pytest.mark.parametrize("case", ["deepseek_v3", "gemma3_text", "gpt_oss", "qwen3_moe", "qwen3_next"], indirect=True)
def test_dspark_speculation_equals_plain(case, drafter_dir):
    """The drafter reads the family's own captured residual streams (MLA's latent cache, page
    groups, MoE layers alike) and verification keeps the plain greedy output. (The dense llama
    variants run DSpark in tests/engine/test_speculative.py.)"""
    variant, directory, _, _, batched = case
    spec = LLM(str(directory), **ENGINE, speculative_config={"method": "dspark", "model": str(drafter_dir),
                                                           "confidence_threshold": 0.0, "adaptive": False})
    outs = spec.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == batched, variant
    assert spec.engine.spec_stats()["spec_num_draft_tokens"] > 0
    assert_no_leaks(spec)
