"""The fused decode (several steps per device call) gives exactly what one step per call gives."""

from __future__ import annotations

import numpy as np
import pytest

from weld import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time there was", "Paris"]


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    make = lambda k: LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01, steps_per_call=k)
    return make(1), make(8)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=21, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=19, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=30, temperature=1.0, seed=3, min_tokens=5),
], ids=["greedy", "seeded-logprobs", "eos-min-tokens"])
def test_steps_per_call_does_not_change_outputs(llms, params):
    one, fused = (llm.generate(PROMPTS, params) for llm in llms)
    for a, b in zip(one, fused):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        if params.logprobs:
            la = [{k: v.logprob for k, v in pos.items()} for pos in a.outputs[0].logprobs]
            lb = [{k: v.logprob for k, v in pos.items()} for pos in b.outputs[0].logprobs]
            assert len(la) == len(lb)
            for pa, pb in zip(la, lb):
                assert pa.keys() == pb.keys()
                np.testing.assert_allclose(list(pa.values()), list(pb.values()), atol=1e-5)
    for llm in llms:
        bm = llm.engine.block_manager
        assert bm.num_free_pages == bm.num_pages


def test_stop_token_ends_a_row_mid_call(llms):
    _, fused = llms
    base = fused.generate("The quick brown fox", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    target = ids[4]
    first = ids.index(target)
    out = fused.generate(["The quick brown fox", "Paris"],
                         SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[target]))
    assert out[0].outputs[0].token_ids == ids[:first + 1] and out[0].outputs[0].stop_reason == target
    assert len(out[1].outputs[0].token_ids) == 20 or out[1].outputs[0].stop_reason == target


def test_max_tokens_exact_with_fused_steps(llms):
    _, fused = llms
    for n in (1, 7, 8, 9, 17):
        out = fused.generate("Paris", SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == n and out.outputs[0].finish_reason == "length"


def test_fused_decode_with_preemption(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01, steps_per_call=1).generate(PROMPTS, params)
    small = LLM(model=str(directory), max_model_len=128, page_size=4, num_pages=12, steps_per_call=8)
    outs = small.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert small.engine.block_manager.num_free_pages == 12


@pytest.mark.parametrize("which", [0, 1])
def test_min_tokens_bans_stop_ids_until_reached(llms, which):
    llm = llms[which]
    base = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    first = base.outputs[0].token_ids[0]
    free = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                              stop_token_ids=[first]))[0].outputs[0]
    assert free.token_ids == [first]  # without min_tokens it stops at once
    held = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                              stop_token_ids=[first], min_tokens=4))[0].outputs[0]
    assert len(held.token_ids) >= 5 or held.finish_reason == "length"
    assert first not in held.token_ids[:4]
    if held.finish_reason == "stop":
        assert held.token_ids[-1] == first and held.stop_reason == first


def test_logit_bias_and_penalties(llms):
    one, fused = llms
    base = fused.generate("Paris", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    forced = fused.generate("Paris", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                    logit_bias={17: 100}))[0].outputs[0]
    assert forced.token_ids == [17] * 6
    banned = fused.generate("Paris", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                    logit_bias={base.token_ids[0]: -100}))[0].outputs[0]
    assert banned.token_ids[0] != base.token_ids[0]
    # A strong frequency penalty forbids repeats; the fused loop's running counts must agree
    # with the counts the host rebuilds for every single-step call.
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=2, ignore_eos=True, frequency_penalty=2.0,
                            presence_penalty=0.5, repetition_penalty=1.3)
    a, b = (llm.generate(PROMPTS, params) for llm in llms)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    with pytest.raises(Exception, match="logit_bias"):
        fused.generate("Paris", SamplingParams(logit_bias={10 ** 7: 1.0}))
