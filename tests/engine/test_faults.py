"""Fault isolation: a row whose logits hold NaN or inf ends its own request with an error and
leaves every neighbour's output as if it had run alone, in prefill, fused decode and speculative
verification; its pages go back to the pool and do not poison their next owner.

The fault is planted in the weights (`nan_token_model`): one token's embedding row is NaN, so any
row that reads that token (in its prompt, or sampled and fed back) computes NaN from there on.
"""

from __future__ import annotations

import pytest

from weld import LLM, SamplingParams
from weld.engine.output_processor import NONFINITE_LOGITS

CLEAN = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "Once upon a time there"]


def _llm(directory, **kwargs) -> LLM:
    return LLM(model=str(directory), dtype="float32", max_model_len=96, max_num_seqs=4, page_size=4, num_pages=24,
               steps_per_call=4, progress=False, **kwargs)


def _greedy(max_tokens=12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _check_isolated(llm: LLM, poison: int) -> None:
    tok = llm.tokenizer
    clean = [tok.encode(p, add_special_tokens=False) for p in CLEAN]
    assert all(poison not in ids for ids in clean)
    solo = [llm.generate({"prompt_token_ids": ids}, _greedy())[0].outputs[0] for ids in clean]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in solo)
    prompts = [{"prompt_token_ids": ids} for ids in clean]
    params = [_greedy() for _ in clean]
    # a prompt holding the poisoned token: NaN from its prefill on
    prompts.insert(1, {"prompt_token_ids": clean[0][:2] + [poison] + clean[0][2:]})
    params.insert(1, _greedy())
    # a request made to sample the poisoned token as its first token: NaN from its first decode on
    prompts.insert(3, {"prompt_token_ids": clean[2]})
    params.insert(3, _greedy(logit_bias={poison: 100.0}))
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    faulted = [outs.pop(3), outs.pop(1)]
    for c in faulted:
        assert c.finish_reason == "error" and c.stop_reason == NONFINITE_LOGITS
    assert faulted[1].token_ids == []  # the prompt's own logits were NaN: nothing came out
    assert faulted[0].token_ids == [poison]  # sampled it, then read it back
    for got, want in zip(outs, solo):
        assert got.token_ids == want.token_ids and got.finish_reason == "length"
    # prefilled together, so the poison is first read in a decode (or verify) call, not a mixed one
    pair = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": clean[1]}, {"prompt_token_ids": clean[2]}],
                                               [_greedy(), _greedy(logit_bias={poison: 100.0})])]
    assert pair[0].token_ids == solo[1].token_ids and pair[0].finish_reason == "length"
    assert pair[1].token_ids == [poison] and pair[1].finish_reason == "error"
    assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_pages
    # the faulted rows' pages, NaN K/V in them, serve new requests (a small pool: each is reused)
    again = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": ids} for ids in clean * 2],
                                                [_greedy() for _ in clean * 2])]
    assert [c.token_ids for c in again] == [c.token_ids for c in solo * 2]


@pytest.mark.parametrize("native", ["1", "0"], ids=["native-attention", "jnp-attention"])
def test_nan_row_ends_alone(nan_token_model, monkeypatch, native):
    monkeypatch.setenv("WELD_CPU_KERNELS", native)  # "0": attention over whole tiles, stale slots weighed by 0
    directory, poison = nan_token_model
    _check_isolated(_llm(directory), poison)


class PoisonProposer:
    """Host drafts that are all the poisoned token: every verified row feeds it after its last
    token, so slots past the first compute NaN logits in every round."""

    def __init__(self, poison: int):
        self.poison = poison

    def propose(self, token_ids: list[int]) -> list[int]:
        return [self.poison] * 3


def test_nan_row_ends_alone_under_speculation(nan_token_model, monkeypatch):
    """Clean rows reject every (poisoned) draft: the NaN logits of the slots after a rejection are
    never used, so they go on as if alone; the row whose own next token is the poison ends."""
    directory, poison = nan_token_model
    llm = _llm(directory, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    llm.engine.proposer = PoisonProposer(poison)
    monkeypatch.setattr(llm.engine.runner, "drafter", None)
    _check_isolated(llm, poison)
    stats = llm.engine.spec_stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] == 0
