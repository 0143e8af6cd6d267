"""Block manager and scheduler as plain Python (no model, no jax)."""

import pytest

from weld.engine.block_manager import BlockManager
from weld.engine.sampling_params import SamplingParams
from weld.engine.scheduler import Scheduler
from weld.engine.sequence import Sequence, SequenceStatus


def seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams(max_tokens=100))


def test_block_manager_allocates_and_frees():
    bm = BlockManager(num_pages=4, page_size=4)
    s = seq(6)
    assert bm.pages_needed(s, 6) == 2 and bm.can_allocate(s, 6)
    bm.allocate(s, 6)
    assert len(s.block_table) == 2 and bm.num_free_pages == 2
    bm.allocate(s, 8)  # still fits in two pages
    assert len(s.block_table) == 2
    assert not bm.can_allocate(s, 17)
    with pytest.raises(RuntimeError):
        bm.allocate(s, 17)
    bm.free(s)
    assert bm.num_free_pages == 4 and s.block_table == []


def test_trim_gives_back_pages_past_the_tokens_kept():
    """Rejected speculative drafts: slots past the kept tokens go back, computed pages never."""
    bm = BlockManager(num_pages=8, page_size=4)
    s = seq(6)
    bm.allocate(s, 6 + 8)  # the last token and 8 draft slots: 4 pages
    s.num_computed_tokens = 5
    pages = list(s.block_table)
    assert len(pages) == 4 and bm.num_free_pages == 4
    bm.trim(s, 7)  # 2 of the drafts were kept: positions 0..6 need 2 pages
    assert s.block_table == pages[:2] and bm.num_free_pages == 6
    s.num_computed_tokens = 8
    bm.trim(s, 3)  # never below the computed tokens
    assert len(s.block_table) == 2
    bm.free(s)
    assert bm.num_free_pages == 8


def sched_verify(k: int, rounds: int) -> Scheduler:
    return Scheduler(BlockManager(num_pages=64, page_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                     num_spec_tokens=k, spec_rounds=rounds)


@pytest.mark.parametrize("k, rounds", [(3, 1), (2, 3)])
def test_speculative_decode_steps_are_verify_plans_with_room_for_every_round(k, rounds):
    sched = sched_verify(k, rounds)
    s = Sequence("r", list(range(5)), SamplingParams(max_tokens=100))
    sched.add(s)
    plan = sched.schedule()
    assert plan.kind == "prefill"
    s.num_computed_tokens = 5
    s.output_token_ids.append(1)
    plan = sched.schedule()
    assert plan.kind == "verify" and plan.entries[0].max_steps == rounds * (k + 1)
    # every slot a round may write (positions 5 .. 5 + rounds * (k + 1) - 1) has a page
    assert len(s.block_table) * 4 >= 5 + rounds * (k + 1)


def test_speculative_budget_stops_at_max_tokens():
    sched = sched_verify(4, 2)
    s = Sequence("r", list(range(5)), SamplingParams(max_tokens=3))
    sched.add(s)
    sched.schedule()
    s.num_computed_tokens = 5
    s.output_token_ids.append(1)
    assert sched.schedule().entries[0].max_steps == 2  # 2 tokens left to produce


def run_to_completion(sched: Scheduler, max_steps: int = 1000, new_tokens: int = 3):
    """Drives the scheduler like the engine does, appending a dummy token on each sample."""
    plans = []
    for _ in range(max_steps):
        plan = sched.schedule()
        if plan is None:
            return plans
        plans.append(plan)
        for e in plan.entries:
            e.seq.num_computed_tokens = e.start + e.num_tokens
            if e.sample:
                e.seq.output_token_ids.append(7)
                if e.seq.num_output_tokens >= new_tokens:
                    sched.finish(e.seq, "length")
    raise AssertionError("did not finish")


def test_prefill_is_chunked_by_token_budget():
    bm = BlockManager(num_pages=64, page_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(23, "a"), seq(5, "b")
    sched.add(a)
    sched.add(b)
    plans = run_to_completion(sched)
    assert all(p.num_tokens <= 10 for p in plans)
    chunks = [(e.seq.request_id, e.start, e.num_tokens, e.sample) for p in plans for e in p.entries[:p.num_prefill]]
    assert chunks[:3] == [("a", 0, 10, False), ("a", 10, 10, False), ("a", 20, 3, True)]
    assert ("b", 0, 5, True) in chunks
    assert a.is_finished and b.is_finished and bm.num_free_pages == 64


def test_preemption_recomputes_newest_and_frees_all():
    bm = BlockManager(num_pages=5, page_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [seq(7, str(i)) for i in range(2)]
    for s in seqs:
        sched.add(s)
    plans = run_to_completion(sched, new_tokens=6)
    assert sched.num_preemptions >= 1
    assert all(s.is_finished and s.num_output_tokens == 6 for s in seqs)
    # A preempted sequence is prefilled again from position 0, its generated tokens included.
    recomputed = [e for p in plans for e in p.entries[:p.num_prefill] if e.seq.num_output_tokens > 0]
    assert recomputed and all(e.start == 0 for e in recomputed)
    assert bm.num_free_pages == 5


def test_running_sequences_decode_while_a_long_prompt_is_chunked():
    bm = BlockManager(num_pages=64, page_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, steps_per_call=4)
    a, b = seq(3, "a"), seq(5, "b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # both prompts fit the budget: a pure prefill
    assert first.kind == "prefill" and [e.seq for e in first.entries] == [a, b]
    for e in first.entries:
        e.seq.num_computed_tokens = e.start + e.num_tokens
        e.seq.output_token_ids.append(7)
    long = seq(20, "long")
    sched.add(long)
    plans = []
    while sched.waiting:
        plan = sched.schedule()
        plans.append(plan)
        assert plan.kind == "mixed" and plan.num_tokens <= 8
        chunk, decodes = plan.entries[:plan.num_prefill], plan.entries[plan.num_prefill:]
        # Each running sequence feeds its one last token; the prompt gets what is left.
        assert [(e.seq, e.num_tokens, e.max_steps) for e in decodes] == [(a, 1, 1), (b, 1, 1)]
        assert [e.seq for e in chunk] == [long] and chunk[0].num_tokens <= 6
        for e in plan.entries:
            e.seq.num_computed_tokens = e.start + e.num_tokens
            if e.sample:
                e.seq.output_token_ids.append(7)
    assert [p.entries[0].num_tokens for p in plans] == [6, 6, 6, 2]
    assert a.num_output_tokens == 1 + len(plans)
    # Nothing waits any more: back to fused decode, several steps per call.
    plan = sched.schedule()
    assert plan.kind == "decode" and {e.max_steps for e in plan.entries} == {4}


def test_finish_while_waiting_frees_pages():
    bm = BlockManager(num_pages=8, page_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=4)
    s = seq(10)
    sched.add(s)
    sched.schedule()  # first chunk: s holds a page but is still waiting
    assert s.status is SequenceStatus.WAITING and s.block_table
    sched.finish(s, "abort")
    assert bm.num_free_pages == 8 and not sched.has_unfinished()


def test_sequence_too_long_for_cache_is_an_error():
    sched = Scheduler(BlockManager(num_pages=2, page_size=4), max_num_seqs=1, max_num_batched_tokens=64)
    sched.add(seq(20))
    with pytest.raises(RuntimeError, match="pages"):
        sched.schedule()


def test_prefix_cache_reuses_full_pages_confirmed_by_tokens():
    bm = BlockManager(num_pages=16, page_size=4)
    a = seq(11, "a")  # tokens 0..10: two full pages (0..3, 4..7) once computed
    bm.allocate(a, 11)
    a.num_computed_tokens = 11
    a_pages = list(a.block_table)
    bm.free(a)  # finished: its full pages stay cached while free
    assert bm.num_free_pages == 16
    b = Sequence("b", list(range(9)) + [99, 98], SamplingParams())
    assert bm.match_prefix(b) == 8 and b.num_computed_tokens == 8
    assert b.block_table == a_pages[:2]  # the very pages a computed, not any two
    assert bm.num_free_pages == 14 and bm.prefix_hits == 8
    bm.allocate(b, 11)  # its third page (8, 99, 98) is new
    assert len(b.block_table) == 3 and b.block_table[2] not in a_pages[:2]
    c = Sequence("c", [0, 1, 2, 3, 7, 7, 7, 7, 1], SamplingParams())
    assert bm.match_prefix(c) == 4  # first page equal, second differs
    assert c.block_table == [a_pages[0]]  # shared with b, ref-counted
    bm.allocate(c, 9)  # tokens that do not match get pages of their own
    assert len(c.block_table) == 3 and not set(c.block_table[1:]) & set(b.block_table)
    bm.free(b)
    assert bm.num_free_pages == 16 - 3  # the shared page is still held by c
    bm.free(c)
    assert bm.num_free_pages == 16


def test_prefix_cache_hits_need_equal_tokens_from_the_first_page():
    """Equal pages behind a different first page are not a prefix: no hit, fresh pages."""
    bm = BlockManager(num_pages=16, page_size=4)
    a = seq(9, "a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    a_pages = list(a.block_table)
    bm.free(a)
    d = Sequence("d", [9, 9, 9, 9, 4, 5, 6, 7, 8], SamplingParams())  # a's second page, after another first
    assert bm.match_prefix(d) == 0 and d.block_table == [] and d.num_computed_tokens == 0
    bm.allocate(d, 9)
    assert not set(d.block_table) & set(a_pages[:2])  # a's cached pages stay cached, untouched
    e = seq(9, "e")
    assert bm.match_prefix(e) == 8 and e.block_table == a_pages[:2]


def test_prefix_cache_leaves_the_last_token_to_compute():
    bm = BlockManager(num_pages=8, page_size=4)
    a = seq(8, "a")
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    a_pages = list(a.block_table)
    bm.free(a)
    same = seq(8, "b")
    assert bm.match_prefix(same) == 4  # not 8: the last page holds the token whose logits we need
    assert same.block_table == a_pages[:1]


def test_evicted_pages_do_not_hit():
    bm = BlockManager(num_pages=2, page_size=4)
    a = seq(5, "a")
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    cached = a.block_table[0]  # tokens 0..3, full and computed
    bm.free(a)
    other = Sequence("x", [50, 51, 52, 53, 54, 55, 56, 57], SamplingParams())
    bm.allocate(other, 8)  # takes both pages, evicting a's cached page
    assert cached in other.block_table
    bm.free(other)
    again = seq(5, "b")
    assert bm.match_prefix(again) == 0 and again.block_table == []


def test_random_requests_with_aborts_leak_no_pages():
    """500 requests with shared prefixes, random lengths, 20% aborted at random moments."""
    import random

    rng = random.Random(0)
    bm = BlockManager(num_pages=40, page_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=64, steps_per_call=3)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    pending = []
    for i in range(500):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        s = Sequence(str(i), prompt, SamplingParams(max_tokens=rng.randrange(1, 12)))
        pending.append((s, rng.random() < 0.2))
    live: list[tuple[Sequence, bool]] = []
    for _ in range(20000):
        while pending and rng.random() < 0.3:
            s, abort = pending.pop()
            sched.add(s)
            live.append((s, abort))
        plan = sched.schedule()
        if plan is None and not pending:
            break
        for e in (plan.entries if plan else []):
            e.seq.num_computed_tokens = e.start + e.num_tokens
            if e.sample:
                for k in range(e.max_steps):
                    if k:
                        e.seq.num_computed_tokens += 1
                    e.seq.output_token_ids.append(rng.randrange(50))
                    if e.seq.num_output_tokens >= e.seq.params.max_tokens:
                        sched.finish(e.seq, "length")
                        break
                if not e.seq.is_finished:
                    bm.cache_full_pages(e.seq)
        for s, abort in live:
            if abort and not s.is_finished and rng.random() < 0.1:
                sched.finish(s, "abort")
    assert not pending and not sched.has_unfinished()
    assert all(s.is_finished for s, _ in live) and len(live) == 500
    assert bm.num_free_pages == bm.num_pages
    assert bm.prefix_hits > 0
