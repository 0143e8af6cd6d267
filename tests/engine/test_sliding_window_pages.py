"""Sliding-window layers keep only their window of pages: a page group per window, whose pages go
back to the pool as the window moves on, and a prefix cache that only hits where every group has
what the rest of the prompt reads."""

from __future__ import annotations

import pytest
import torch

from weld import LLM, SamplingParams
from weld.engine.block_manager import BlockManager
from weld.engine.sampling_params import SamplingParams as Params
from weld.engine.sequence import Sequence


def seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(n)), Params(max_tokens=100))


def live(table: list[int]) -> list[int]:
    return [p for p in table if p >= 0]


def test_a_sliding_group_frees_the_pages_its_window_left():
    bm = BlockManager([16, 16], page_size=4, windows=(None, 6))
    s = seq(20)
    bm.allocate(s, 20)
    assert [len(t) for t in s.block_tables] == [5, 5]
    s.num_computed_tokens = 20  # the next query is at 20 and sees 15..20: pages 3 and 4
    bm.release_outside_window(s)
    assert len(live(s.block_tables[0])) == 5  # the full-context group keeps everything
    assert s.block_tables[1][:3] == [-1, -1, -1] and len(live(s.block_tables[1])) == 2
    assert bm.pools[1].refs.count(1) == 2 and len(bm.pools[1].free) == 14
    bm.allocate(s, 26)  # the tables keep growing at the end
    assert len(s.block_tables[1]) == 7
    bm.free(s)
    assert bm.num_free_pages == bm.num_pages and s.block_tables == [[], []]


def test_a_prefix_hit_needs_the_window_before_it_in_every_group():
    bm = BlockManager([32, 32], page_size=4, windows=(None, 6))
    a = seq(17, "a")
    bm.allocate(a, 17)
    a.num_computed_tokens = 17
    bm.cache_full_pages(a)
    full_pages, window_pages = list(a.block_tables[0]), list(a.block_tables[1])
    bm.release_outside_window(a)  # pages 0..2 of the sliding group are free again, still cached
    assert a.block_tables[1][:3] == [-1] * 3
    bm.free(a)
    b = seq(17, "b")  # the same prompt: 4 full pages hit, the last token is left to compute
    assert bm.match_prefix(b) == 16
    assert b.block_tables[0] == full_pages[:4]
    # after a hit of 16 tokens the queries see 11..: sliding pages 2 and 3 only
    assert b.block_tables[1] == [-1, -1] + window_pages[2:4]
    bm.free(b)
    # Evict the sliding group's page 3: the hit falls back to where the window before it is cached.
    victim = window_pages[3]
    while victim in bm.pools[1].free:
        bm.pools[1].take()  # hand free pages out (LRU first) until the victim is reused
    c = seq(17, "c")
    hit = bm.match_prefix(c)
    assert hit < 16 and all(p != victim for p in c.block_tables[1])
    assert c.block_tables[0] == full_pages[:hit // 4]


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def gemma(tiny_family_dir):
    directory, hf = tiny_family_dir("gemma3_text")  # five layers with a window of 4, one full
    llm = LLM(str(directory), dtype="float32", max_model_len=128, page_size=4, kv_cache_memory_gb=0.001,
              max_num_seqs=2, max_num_batched_tokens=16, steps_per_call=4)
    return llm, hf


def test_the_engine_sizes_and_frees_each_group(gemma):
    llm, hf = gemma
    bm = llm.engine.block_manager
    assert [p.window for p in bm.pools] == [None, 4]
    # The sliding pool holds windows (+ a chunk and a call's steps), not whole sequences.
    assert bm.pools[1].num_pages < bm.pools[0].num_pages / 3
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm.engine.add_request("r", prompt, params)
    s = llm.engine.requests["r"].completions[0].seq
    most_window_pages, tokens = 0, []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            tokens = list(out.outputs[0].token_ids)
        if not s.is_finished:
            assert len(live(s.block_tables[0])) == len(s.block_tables[0])  # the full group keeps all
            most_window_pages = max(most_window_pages, len(live(s.block_tables[1])))
    # window 4 + one 16-token chunk or one 4-step call ahead, on pages of 4: never more than 7
    assert 0 < most_window_pages <= 7 < -(-(len(prompt) + 40) // 4)
    assert tokens == hf_greedy(hf, prompt, 40)  # freeing what the window left changed nothing
    assert bm.num_free_pages == bm.num_pages


def test_a_sliding_only_model_takes_requests_longer_than_its_pool(tiny_family_dir):
    """Every Mistral layer has a window of 6: its one pool holds windows, and a request far longer
    than the pool runs to the end (pages come back as the window moves)."""
    llm = LLM(str(tiny_family_dir("mistral")[0]), dtype="float32", max_model_len=200, page_size=4, num_pages=12,
              max_num_seqs=1, max_num_batched_tokens=16, steps_per_call=4)
    bm = llm.engine.block_manager
    assert [p.window for p in bm.pools] == [6] and bm.full_context_pages is None
    out = llm.generate({"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=60, temperature=0,
                                                                                 ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 60 and -(-(37 + 60) // 4) > bm.num_pages
    assert bm.num_free_pages == bm.num_pages
