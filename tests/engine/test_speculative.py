"""Speculative decoding through the engine: verification in the runner, rollback by length,
speculative and plain requests in one batch. Greedy outputs must be token-for-token those of
plain decoding, whatever the proposer drafts."""

from __future__ import annotations

import dataclasses
import random

import pytest

from weld import LLM, SamplingParams
from weld.utils.errors import InvalidInputError

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=4,
              num_pages=160, steps_per_call=4, progress=False)


def copy_prompts(vocab: int, rng: random.Random, count: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: the kind of text n-gram lookup drafts well."""
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
        prompts.append((phrase * 6)[:rng.randrange(12, 40)])
    return prompts


def greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir[0]), **ENGINE)


@pytest.fixture(scope="module")
def prompts(plain):
    return copy_prompts(plain.cfg.vocab_size, random.Random(0), 6)


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return greedy_ids(plain, prompts)


@pytest.fixture(scope="module")
def ngram(tiny_llama_dir):
    """One n-gram engine for the module (each test leaves it empty)."""
    return LLM(model=str(tiny_llama_dir[0]), speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
               **ENGINE)


def assert_no_leak(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"], stats
    assert not llm.engine.has_unfinished()


def test_ngram_greedy_equals_plain(ngram, prompts, reference):
    llm = ngram
    assert greedy_ids(llm, prompts) == reference
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0, "the copy prompts should have produced drafts"
    assert stats["spec_num_accepted_tokens"] > 0
    assert sum(stats["spec_drafted_per_position"]) == stats["spec_num_draft_tokens"]
    assert all(a <= d for a, d in zip(stats["spec_accepted_per_position"], stats["spec_drafted_per_position"]))
    assert_no_leak(llm)


def test_draft_model_equal_to_target_accepts_everything(tiny_llama_dir, prompts, reference):
    """The target as its own draft model drafts exactly the target's argmax: every draft is
    accepted (which proves the draft cache stays in step with the target's), outputs unchanged."""
    llm = LLM(model=str(tiny_llama_dir[0]),
              speculative_config={"method": "draft_model", "model": str(tiny_llama_dir[0]),
                                  "num_speculative_tokens": 3, "rounds_per_call": 3, "adaptive": False}, **ENGINE)
    assert greedy_ids(llm, prompts) == reference
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    assert stats["spec_mean_acceptance_length"] == pytest.approx(4.0, abs=0.6)  # max_tokens cuts the last rounds
    assert_no_leak(llm)


def test_different_draft_model_keeps_outputs(tiny_llama_dir, tiny_draft_dir, prompts, reference):
    llm = LLM(model=str(tiny_llama_dir[0]),
              speculative_config={"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 2,
                                  "adaptive": False},
              **ENGINE)
    assert greedy_ids(llm, prompts) == reference
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], "a random draft model must miss"
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def self_draft(tiny_llama_dir):
    """The target as its own draft model, 3 rounds per call: every draft is accepted, so stops
    and budgets must cut inside accepted blocks, on device."""
    return LLM(model=str(tiny_llama_dir[0]),
               speculative_config={"method": "draft_model", "model": str(tiny_llama_dir[0]),
                                   "num_speculative_tokens": 3, "rounds_per_call": 3, "adaptive": False}, **ENGINE)


@pytest.mark.parametrize("engine", ["ngram", "self_draft"])
def test_mixed_speculative_and_plain_rows(engine, request, plain, prompts):
    """Penalised requests send no drafts but share the verification batch; each request's output
    equals its output without speculation, and stop ids, min_tokens and max_tokens cut drafts
    correctly."""
    llm = request.getfixturevalue(engine)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5, frequency_penalty=0.3)]
    requests = [({"prompt_token_ids": p}, params[i % len(params)]) for i, p in enumerate(prompts)]
    stop_at = greedy_ids(plain, [prompts[0]], 20)[0][5]
    requests.append(({"prompt_token_ids": prompts[0]},
                     SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at], ignore_eos=True)))
    requests.append(({"prompt_token_ids": prompts[0]},  # the stop id is banned until 8 tokens are out
                     SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at], min_tokens=8,
                                    ignore_eos=True)))

    def run(engine):
        outs = engine.generate([r for r, _ in requests], [p for _, p in requests], use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]

    together = run(llm)
    assert together == run(plain)
    assert len(together[2][0]) == 7 and together[2][1] == "length"
    assert together[-2][0][-1] == stop_at and together[-2][1] == "stop"
    assert len(together[-1][0]) >= 8
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)


def test_sampled_requests_and_aborts_leak_nothing(ngram):
    llm = ngram
    rng = random.Random(5)
    engine = llm.engine
    prompts = copy_prompts(llm.cfg.vocab_size, rng, 24)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=rng.randrange(1, 30), temperature=rng.choice([0, 0.7, 1.2]),
                                                     top_p=rng.choice([1.0, 0.9]), seed=i))
    finished, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps % 3 == 0 and engine.requests:
            engine.abort(rng.choice(sorted(engine.requests)))
    for out in finished.values():
        if out.outputs[0].finish_reason != "abort":
            assert 1 <= len(out.outputs[0].token_ids) <= 30
    assert_no_leak(llm)


def test_sampled_speculation_is_seed_reproducible(ngram, prompts):
    llm = ngram
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=7)
    one = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    two = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one[:2]] == [o.outputs[0].token_ids for o in two]


@pytest.mark.parametrize("engine", ["ngram", "self_draft"])
def test_sampled_speculation_gives_the_very_tokens_of_plain_sampling(engine, request, plain, prompts):
    """Each slot's token is the target's own seeded draw there, drafts only decide how many come
    per round: a seeded sampled request says exactly what it says without speculation (while
    drafts are accepted and rejected)."""
    llm = request.getfixturevalue(engine)
    before = llm.engine.stats()
    params = [SamplingParams(max_tokens=20, temperature=t, top_p=p, seed=s, ignore_eos=True)
              for s, (t, p) in enumerate([(0.2, 1.0), (1.0, 0.9), (0.3, 1.0), (0.5, 0.8), (0.25, 1.0), (1.1, 0.95)])]
    requests = [{"prompt_token_ids": p} for p in prompts]
    spec = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert spec == [o.outputs[0].token_ids for o in plain.generate(requests, params, use_tqdm=False)]
    after = llm.engine.stats()
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert 0 < accepted < drafted
    assert_no_leak(llm)


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "draft_model"}, "draft model"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "k": 3}, "unknown"),
    ({"method": "ngram", "rounds_per_call": 0}, "rounds_per_call"),
    ({"method": "dspark"}, "no DSpark drafter ships for"),  # only the bundled model has one built in
])
def test_bad_speculative_config(tiny_llama_dir, config, message):
    with pytest.raises(InvalidInputError, match=message):
        LLM(model=str(tiny_llama_dir[0]), speculative_config=config, **ENGINE)


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory, plain):
    """A randomly initialised DSpark drafter for the tiny llama (block of 3, two context layers)."""
    from weld.engine.spec import dspark

    cfg = dspark.DraftConfig.for_target(plain.cfg, block_size=3, target_layers=(0, 1), num_heads=4,
                                        num_kv_heads=2, head_dim=16, intermediate_size=64, markov_rank=8)
    params = dspark.init_params(cfg, seed=4, target_weights=plain.model.weights)
    rng = __import__("numpy").random.default_rng(2)  # non-zero Markov bias and confidence: every term counts
    params["markov_out"] = params["markov_out"] + 0.3 * rng.standard_normal(params["markov_out"].shape)
    params["confidence"] = params["confidence"] + 0.3 * rng.standard_normal(params["confidence"].shape)
    directory = tmp_path_factory.mktemp("dspark")
    dspark.save(directory, params, cfg)
    return directory


def test_dspark_greedy_equals_plain(tiny_llama_dir, dspark_dir, prompts, reference):
    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={"method": "dspark", "model": str(dspark_dir),
                                                                 "confidence_threshold": 0.0, "rounds_per_call": 2,
                                                                 "adaptive": False},
              **ENGINE)
    assert llm.engine.scheduler.num_spec_tokens == 3  # the drafter's block size
    assert greedy_ids(llm, prompts) == reference
    stats = llm.engine.stats()
    # Threshold 0 sends every draft the row has room for (only max_tokens cuts the last blocks).
    assert stats["spec_drafted_per_position"][0] == stats["spec_num_drafts"] > 0
    assert stats["spec_num_draft_tokens"] > 2.5 * stats["spec_num_drafts"]
    assert_no_leak(llm)


@pytest.mark.parametrize("plain_call", [False, True])
def test_dspark_paged_drafts_match_dense_reference(tiny_llama_dir, dspark_dir, plain, plain_call):
    """After the engine prefilled a prompt (and, with plain_call, ran a plain fused decode call,
    as an adaptive engine may), the drafter's paged context (written by the target's forwards,
    page by page) drafts exactly what the dense reference drafts from the same prefix."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from weld.engine.spec import dspark
    from weld.engine.spec.features import target_hidden_states
    from weld.engine.spec.policy import WidthPolicy

    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={"method": "dspark", "model": str(dspark_dir)},
              **ENGINE)
    prompt = copy_prompts(llm.cfg.vocab_size, random.Random(9), 1)[0]
    llm.engine.add_request("r", prompt, SamplingParams(max_tokens=50, temperature=0))
    llm.engine.step()  # the prefill (samples the first token)
    if plain_call:
        llm.engine.width_policy = WidthPolicy((0,))
        llm.engine.step()
        assert llm.engine.requests["r"].completions[0].seq.num_output_tokens == 1 + ENGINE["steps_per_call"]
    seq = llm.engine.requests["r"].completions[0].seq
    runner, drafter = llm.engine.runner, llm.engine.runner.drafter
    tokens = seq.token_ids()
    anchor, position = tokens[-1], len(tokens) - 1
    tables = np.zeros((1, runner.max_pages_per_seq), np.int32)
    tables[0, :len(seq.block_table)] = seq.block_table
    params, cfg = runner.draft_params, drafter.cfg
    features, _ = target_hidden_states(llm.model.family, runner.weights, llm.cfg, jnp.asarray([tokens[:-1]]), cfg.target_layers)
    context = dspark.project_context(params, cfg, features)
    ctx_positions = jnp.arange(len(tokens) - 1)[None]
    ctx_kv = dspark.context_kv(params, cfg, context, ctx_positions)
    # every draft sent (0), the drafter's own threshold, none sent (above any confidence): the
    # engine's drafter skips its head when no row would send a draft, so it must then send none
    for threshold in (0.0, drafter.threshold, 1.01):
        engine_drafter = dataclasses.replace(drafter, threshold=threshold)
        _, paged, num = jax.jit(lambda st: engine_drafter.propose(runner.draft_params, st, runner.weights,
                                                                  jnp.asarray([anchor]), jnp.asarray([position]),
                                                                  jnp.asarray(tables), jnp.asarray([4]), 3))(
            runner.draft_state)
        dense = dspark.propose(params, cfg, runner.weights, ctx_kv, ctx_positions, jnp.asarray([anchor]),
                               jnp.asarray([position]), threshold=threshold)
        sent = int(dense.num_drafts[0])
        assert int(num[0]) == sent == {0.0: 3, 1.01: 0}.get(threshold, sent)
        assert np.asarray(paged)[0, :sent].tolist() == np.asarray(dense.tokens)[0, :sent].tolist()
    llm.engine.abort("r")
    assert_no_leak(llm)


@pytest.mark.slow
def test_ngram_on_megakernel_verify_block(tiny_llama_dir, prompts, reference):
    """backend='megakernel' verifies drafts with the kernel's verify block (Pallas interpret mode)."""
    llm = LLM(model=str(tiny_llama_dir[0]), backend="megakernel",
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}, **ENGINE)
    assert greedy_ids(llm, prompts[:2], max_tokens=10) == [r[:10] for r in reference[:2]]
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)


def test_ngram_drafts_several_rounds_in_one_device_call(tiny_llama_dir, prompts, reference):
    """n-gram lookup runs on the device inside the loop: one call verifies several rounds per
    row (more tokens than one round could give), and greedy outputs stay those of plain decoding."""
    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "rounds_per_call": 4, "adaptive": False}, **ENGINE)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    most, rounds_seen, outputs = 0, 0, {}
    while engine.has_unfinished():
        before = {s.seq_id: s.num_output_tokens for s in engine.scheduler.running}
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        for s in engine.scheduler.running:
            if s.seq_id in before:
                most = max(most, s.num_output_tokens - before[s.seq_id])
    assert [outputs[str(i)] for i in range(len(prompts))] == reference
    assert most > 4, "a call should have produced more than one round's k + 1 tokens for some row"
    assert_no_leak(llm)


def test_adaptive_widths_are_all_tried_and_change_nothing_but_speed(tiny_llama_dir, prompts, reference):
    """The default adaptive engine tries every width (plain decode included) and keeps the
    greedy outputs of plain decoding."""
    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **ENGINE)
    kinds = []
    execute = llm.engine.runner.execute

    def traced(plan, **kwargs):
        kinds.append((plan.kind, plan.spec_width))
        return execute(plan, **kwargs)

    llm.engine.runner.execute = traced
    for _ in range(3):  # the policy carries over from run to run
        assert greedy_ids(llm, prompts) == reference
    assert {("decode", 0), ("verify", 1), ("verify", 3)} <= set(kinds)
    assert set(llm.engine.stats()["spec_width_rates"]) >= {"b8_w0", "b8_w1", "b8_w3"}
    assert_no_leak(llm)
