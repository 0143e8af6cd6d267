"""Speculative sampling through the engine keeps the target's distribution, for every method.

On the tiny model, the first three sampled tokens (temperature 1, top-k 6) have an exact joint
distribution, computed here from the plain engine's logprobs: p(t1) over the top 6 after the
prompt, p(t2 | t1) over the top 6 after prompt + t1, and so on. Each speculative engine samples
the triple many times (one seed per sample; the first token comes from the prompt's step, the
next two from a verification round whose drafts are both accepted and rejected: the stats say
so), and a chi-square goodness-of-fit test compares the counts with the exact distribution. A
verifier that accepted drafts too often or resampled from the wrong distribution fails it by a
wide margin.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from weld import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=64, max_num_batched_tokens=256, page_size=4,
              num_pages=600, steps_per_call=4, progress=False)
TOP_K, TEMPERATURE, SAMPLES = 6, 1.0, 1200


def top_distribution(llm: LLM, prompt: list[int]) -> dict[int, float]:
    """The sampling distribution of the next token: softmax(logit / T) over the top TOP_K."""
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, logprobs=TOP_K),
                       use_tqdm=False)[0]
    top = out.outputs[0].logprobs[0]
    ranked = sorted(top.items(), key=lambda kv: kv[1].rank)[:TOP_K]
    lp = np.asarray([x.logprob for _, x in ranked]) / TEMPERATURE
    p = np.exp(lp - lp.max())
    return {token: float(q) for (token, _), q in zip(ranked, p / p.sum())}


def exact_triples(plain: LLM, prompt: list[int]) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        out = {prefix + (t,): p * q for prefix, p in out.items()
               for t, q in top_distribution(plain, prompt + list(prefix)).items()}
    return out


def sampled_triples(llm: LLM, prompt: list[int]) -> list[tuple[int, ...]]:
    """SAMPLES triples, in calls of one request with n = 60: every sequence then decodes its
    second and third tokens in one verification (no prompt waits)."""
    triples = []
    for seed in range(SAMPLES // 60):
        params = SamplingParams(n=60, max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=seed, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        triples += [tuple(c.token_ids) for c in out.outputs]
    return triples


def goodness_of_fit(pairs: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """p-value of the counts against the exact distribution, cells with fewer than 5 expected
    samples pooled into one."""
    cells = sorted(exact, key=exact.get, reverse=True)
    counts = {cell: 0 for cell in cells}
    for pair in pairs:
        assert pair in counts, f"{pair} lies outside the top-{TOP_K} support: the sampler broke its filter"
        counts[pair] += 1
    expected = np.asarray([exact[c] * len(pairs) for c in cells])
    observed = np.asarray([counts[c] for c in cells], float)
    big = expected >= 5
    expected = np.append(expected[big], expected[~big].sum())
    observed = np.append(observed[big], observed[~big].sum())
    if expected[-1] == 0:
        expected, observed = expected[:-1], observed[:-1]
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir[0]), **ENGINE)


@pytest.fixture(scope="module")
def lookup_prompt(plain):
    """One token x repeated, x chosen so that the target ranks x high after it: whenever the
    first sampled token is x, lookup drafts x again, and the target sometimes accepts it."""
    vocab = plain.cfg.vocab_size
    prompts = [{"prompt_token_ids": [x] * 12} for x in range(3, vocab)]
    outs = plain.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=TOP_K), use_tqdm=False)

    def share(out):  # x's probability among the top TOP_K after [x] * 12 (0 when not among them)
        top = out.outputs[0].logprobs[0]
        x = out.prompt_token_ids[0]
        lp = {t: v.logprob for t, v in top.items() if v.rank <= TOP_K}
        return np.exp(lp[x]) / sum(np.exp(v) for v in lp.values()) if x in lp else 0.0

    best = max(outs, key=share)
    assert share(best) > 0.2
    return list(best.prompt_token_ids)


def check(llm: LLM, plain: LLM, prompt: list[int]) -> None:
    triples = sampled_triples(llm, prompt)
    stats_ = llm.engine.stats()
    assert 0 < stats_["spec_num_accepted_tokens"] < stats_["spec_num_draft_tokens"], stats_
    p = goodness_of_fit(triples, exact_triples(plain, prompt))
    assert p > 1e-3, f"sampled pairs do not follow the target's distribution (chi-square p = {p:.2e})"
    assert llm.engine.stats()["num_free_pages"] == llm.engine.stats()["num_pages"]


def test_plain_sampling_matches_the_exact_distribution(plain, lookup_prompt):
    """The harness itself: plain sampling passes, and a distribution of the wrong temperature fails."""
    pairs = sampled_triples(plain, lookup_prompt)
    exact = exact_triples(plain, lookup_prompt)
    assert goodness_of_fit(pairs, exact) > 1e-3
    sharper = {cell: p ** 2 for cell, p in exact.items()}
    total = sum(sharper.values())
    assert goodness_of_fit(pairs, {cell: p / total for cell, p in sharper.items()}) < 1e-3


def test_ngram_sampling_keeps_the_distribution(tiny_llama_dir, plain, lookup_prompt):
    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, "adaptive": False}, **ENGINE)
    check(llm, plain, lookup_prompt)


def test_draft_model_sampling_keeps_the_distribution(tiny_llama_dir, plain, lookup_prompt):
    """The target as its own draft model drafts its argmax: often accepted, sometimes not."""
    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={
        "method": "draft_model", "model": str(tiny_llama_dir[0]), "num_speculative_tokens": 2,
        "adaptive": False}, **ENGINE)
    check(llm, plain, lookup_prompt)


def test_dspark_sampling_keeps_the_distribution(tiny_llama_dir, plain, lookup_prompt, tmp_path):
    """A random DSpark drafter whose draft vocabulary is the target's likely tokens here, so its
    drafts are accepted at times."""
    import jax.numpy as jnp

    from weld.engine.spec import dspark
    from weld.models.common.spec import random_weights

    likely = set()
    for t1 in top_distribution(plain, lookup_prompt):
        likely |= set(top_distribution(plain, lookup_prompt + [t1]))
    vocab = np.asarray(sorted(likely), np.int32)
    cfg = dspark.DraftConfig.for_target(plain.cfg, block_size=2, num_heads=2, num_kv_heads=2, head_dim=16,
                                        intermediate_size=64, markov_rank=8, draft_vocab_size=len(vocab),
                                        target_layers=(0, 1))
    params = {**random_weights(dspark.weight_specs(cfg), seed=3), "draft_vocab": jnp.asarray(vocab)}
    dspark.save(tmp_path / "drafter", params, cfg)
    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={
        "method": "dspark", "model": str(tmp_path / "drafter"), "confidence_threshold": 0.0, "adaptive": False}, **ENGINE)
    check(llm, plain, lookup_prompt)
