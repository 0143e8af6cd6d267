"""A verification round's forward takes as many tokens per row as its widest row feeds (rounded
up to a power of two), not always the k + 1 of the call's width: what the round feeds, the
branch it picks, and the greedy outputs (those of plain decoding) through the engine."""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine.test_speculative import copy_prompts  # n-gram lookup drafts them, some rounds fewer than k
from weld import LLM, SamplingParams
from weld.engine import programs

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=4,
              num_pages=160, steps_per_call=4, progress=False)


@pytest.mark.parametrize("s, widths", [(1, (1,)), (2, (1, 2)), (3, (1, 2, 3)), (4, (1, 2, 4)), (6, (1, 2, 4, 6)),
                                       (8, (1, 2, 4, 8))])
def test_round_widths_are_the_powers_of_two_below_the_block_then_the_block(s, widths):
    assert programs.round_widths(s) == widths


def test_round_width_index_picks_the_narrowest_width_that_holds_the_widest_row():
    widths = programs.round_widths(8)  # (1, 2, 4, 8)
    cases = {(0, 0): 0, (1, 0): 1, (0, 2): 2, (3, 1): 2, (4, 0): 3, (7, 7): 3}
    for sent, index in cases.items():
        assert int(programs.round_width_index(jnp.asarray(sent, jnp.int32), widths)) == index, sent


def test_switch_runs_exactly_the_chosen_branch():
    calls = []

    def branch(j):
        def run(x):
            jax.debug.callback(lambda: calls.append(j), ordered=True)
            return x + 10 ** j, jnp.int32(j)
        return run

    run = jax.jit(lambda i, x: programs.switch(i, tuple(branch(j) for j in range(4)), x))
    for i in (2, 0, 3):
        calls.clear()
        x, aux = run(jnp.int32(i), jnp.zeros((3,), jnp.float32))
        jax.block_until_ready(x)
        assert calls == [i]
        assert int(aux) == i and np.asarray(x).tolist() == [10.0 ** i] * 3




def test_each_round_feeds_only_the_tokens_its_widest_row_sends(tiny_llama_dir):
    """An n-gram engine (k = 3, so rounds of 1, 2 or 4 tokens a row): every round's forward is as
    wide as the narrowest of those that holds the widest row's last token and drafts, and the
    greedy outputs are those of plain decoding."""
    plain = LLM(model=str(tiny_llama_dir[0]), **ENGINE)
    prompts = copy_prompts(plain.cfg.vocab_size, random.Random(3), 4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = [list(o.outputs[0].token_ids) for o in plain.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    llm = LLM(model=str(tiny_llama_dir[0]), speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "rounds_per_call": 3, "adaptive": False}, **ENGINE)
    runner = llm.engine.runner
    fed = []  # the forward's tokens per row, round by round

    def counting(weights, cfg, tokens, *args, **kwargs):
        jax.debug.callback(lambda: fed.append(tokens.shape[1]), ordered=True)
        return runner.family.forward(weights, cfg, tokens, *args, **kwargs)

    runner._verify = jax.jit(functools.partial(programs.verify, counting, runner.drafter, sink=None),
                             static_argnames=("cfg", "num_top", "rounds"), donate_argnames=("cache", "draft_state"))
    sent_rounds = []
    execute = runner.execute

    def logged(plan, **kwargs):
        result = execute(plan, **kwargs)
        if plan.kind == "verify":
            sent_rounds.extend(result.num_drafts.T.tolist())  # [rounds][rows]
        return result

    runner.execute = logged
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    expected = [programs.round_widths(4)[int(programs.round_width_index(jnp.asarray(np.maximum(s, 0)),
                                                                        programs.round_widths(4)))]
                for s in sent_rounds if max(s) >= 0]  # rounds where some row was live
    assert fed == expected
    assert {1, 2, 4} <= set(fed), fed  # the test covers every width
