"""Batch invariance: a request's tokens and log probabilities do not depend on what else the
engine runs beside it (bit for bit). On the bundled GGUF (its Q4_1 / Q8_0 blocks kept, activations rounded to
int8 per block) an ulp anywhere used to flip roundings downstream: 8 of 16 greedy prompts came
out different batched than alone (docs/reliability.md). Compared bit for bit."""

from __future__ import annotations

import random

import pytest

from weld import LLM, SamplingParams

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has "
         "had not but what all when there can more one about if out so up into them some could time these two "
         "may then do first any like now my such new over only me even most made after also did many before").split()


def prompts(count: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 150))) for _ in range(count)]


def outputs(llm: LLM, batch: list[str], params: SamplingParams) -> list[tuple]:
    return [(tuple(c.token_ids), tuple(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
            for out in llm.generate(batch, params, use_tqdm=False) for c in out.outputs]


@pytest.mark.parametrize("settings", [
    # chunked prefill beside decode rows (a small token budget), prefix caching on
    dict(max_num_batched_tokens=128),
    # n-gram speculation: verification rows of k + 1 tokens
    pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}), marks=pytest.mark.slow),
    # the blocks dequantized to f32: the packed f32 matmul (its one-row path too)
    pytest.param(dict(quantization="none", max_num_batched_tokens=128), marks=pytest.mark.slow),
], ids=["chunked", "ngram", "f32"])
def test_bundled_gguf_requests_equal_themselves_alone(settings):
    llm = LLM(max_model_len=512, kv_cache_memory_gb=0.1, **settings)
    texts = prompts(6)
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    alone = [outputs(llm, [t], greedy)[0] for t in texts]
    assert outputs(llm, texts, greedy) == alone
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, n=2, logprobs=0)
    alone = [o for t in texts[:3] for o in outputs(llm, [t], seeded)]
    assert outputs(llm, texts[:3], seeded) == alone


@pytest.mark.slow
def test_speculation_on_the_bundled_gguf_changes_no_bit():
    """A verification pass scores each slot as a decode step would, to the bit, so n-gram
    speculation on the quantized model says the very tokens, with the very log probabilities, of
    plain decoding (before batch invariance: up to near-ties, docs/speculative.md)."""
    texts = prompts(8, seed=3)
    greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=0)
    results = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(max_model_len=512, kv_cache_memory_gb=0.1, speculative_config=spec)
        results.append(outputs(llm, texts, greedy))
        del llm
    assert results[0] == results[1]
