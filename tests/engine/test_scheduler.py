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


@pytest.mark.parametrize("running", [0, 2])
def test_one_step_admits_up_to_max_num_seqs_prompts(running):
    """Prompts that finish in this step's chunks count once toward max_num_seqs (they join the
    running sequences), not twice."""
    bm = BlockManager(num_pages=64, page_size=4)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=64)
    for i in range(running):
        sched.add(seq(3, f"old{i}"))
    if running:
        for e in sched.schedule().entries:
            e.seq.num_computed_tokens = e.start + e.num_tokens
            e.seq.output_token_ids.append(7)
    assert len(sched.running) == running
    for i in range(8):
        sched.add(seq(5, str(i)))
    plan = sched.schedule()
    assert plan.num_prefill == 6 - running and len(sched.running) == 6


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


def random_traffic(sched: Scheduler, pending: list, rng, run, check=lambda: None, steps: int = 20000) -> list:
    """Random traffic: requests from `pending` ((sequence, abort?) popped from the end) arrive at
    random steps, each plan goes to run(plan), and the ones marked for abort are aborted at random
    moments; check() after every step. Returns every (sequence, abort?) that arrived."""
    live: list[tuple[Sequence, bool]] = []
    for _ in range(steps):
        while pending and rng.random() < 0.3:
            s, abort = pending.pop()
            sched.add(s)
            live.append((s, abort))
        plan = sched.schedule()
        if plan is None and not pending:
            break
        if plan is not None:
            run(plan)
        for s, abort in live:
            if abort and not s.is_finished and rng.random() < 0.1:
                sched.finish(s, "abort")
        check()
    return live


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
    def run(plan):
        for e in plan.entries:
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

    live = random_traffic(sched, pending, rng, run)
    assert not pending and not sched.has_unfinished()
    assert all(s.is_finished for s, _ in live) and len(live) == 500
    assert bm.num_free_pages == bm.num_pages
    assert bm.prefix_hits > 0


# ----- recurrent-state slots and snapshots (models with linear-attention layers) -----


def hybrid(num_pages: int = 64, num_slots: int = 4, num_snapshot_slots: int = 4, interval: int = 2,
           prefix: bool = True) -> BlockManager:
    return BlockManager(num_pages, page_size=4, enable_prefix_caching=prefix, num_slots=num_slots,
                        num_snapshot_slots=num_snapshot_slots, snapshot_interval=interval)


class FakeDevice:
    """Runs plans the way the runner does, with state slots that hold the tokens their state sums
    up: it makes each plan's slot copies wave by wave, checks that every row continuing from its
    slot (start > 0) finds the state of exactly its tokens before `start`, and leaves there the
    state after the tokens it feeds. Rows produce random tokens; 5% of rows stop on the host (a
    stop string) part-way through what the device produced, leaving their state past them."""

    def __init__(self, sched: Scheduler, rng, vocab: int = 50):
        self.sched, self.rng, self.vocab = sched, rng, vocab
        self.slots: dict[int, tuple[int, ...]] = {}
        self.continued = 0  # rows that read their slot's state

    def run(self, plan) -> None:
        for wave in plan.slot_copies:
            values = [self.slots.get(src) for src, _ in wave]  # every source read before any write
            for (_, dst), value in zip(wave, values):
                self.slots[dst] = value
        used = [e.seq.state_slot for e in plan.entries]
        assert min(used) >= 0 and len(set(used)) == len(used), used
        appended = []
        for e in plan.entries:
            seq, tokens = e.seq, e.seq.token_ids()
            if e.start > 0:
                assert self.slots.get(seq.state_slot) == tuple(tokens[:e.start]), (seq, e.start)
                self.continued += 1
            fed = tokens[:e.start + e.num_tokens]
            if not e.sample:
                self.slots[seq.state_slot] = tuple(fed)
                appended.append(0)
                continue
            new = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, e.max_steps))]
            self.slots[seq.state_slot] = tuple(fed + new[:-1])  # each new token but the last is fed back
            taken = 0
            for token in new:
                seq.output_token_ids.append(token)
                taken += 1
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.stop("length")
                elif self.rng.random() < 0.05:
                    seq.stop("stop")
                if seq.stopping:
                    break
            appended.append(taken)
        self.sched.update_from_output(plan, appended)


def assert_slots_consistent(sched: Scheduler) -> None:
    """Running sequences hold distinct live slots; a waiting one holds one only with pages."""
    bm = sched.block_manager
    held = [s.state_slot for s in sched.running]
    assert min(held, default=0) >= 0 and len(set(held)) == len(held)
    held += [s.state_slot for s in sched.waiting if s.state_slot >= 0]
    assert all(s.state_slot < 0 for s in sched.waiting if not any(s.block_tables))
    assert len(set(held)) == len(held) and all(0 <= h < bm.num_slots for h in held)
    assert len(held) + bm.num_free_slots == bm.num_slots and not set(held) & set(bm.free_slots)


def drive(sched: Scheduler, device: FakeDevice, max_steps: int = 1000) -> list:
    plans = []
    for _ in range(max_steps):
        plan = sched.schedule()
        if plan is None:
            return plans
        plans.append(plan)
        device.run(plan)
        assert_slots_consistent(sched)
    raise AssertionError("did not finish")


def test_state_slots_come_with_the_first_pages_and_go_with_preemption_and_finish():
    import random

    bm = hybrid(num_pages=5, prefix=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [Sequence(str(i), list(range(7)), SamplingParams(max_tokens=6)) for i in range(2)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [e.seq.state_slot for e in plan.entries] == [0, 1] and bm.num_free_slots == 2
    device = FakeDevice(sched, random.Random(0))
    device.run(plan)
    drive(sched, device)
    assert sched.num_preemptions >= 1  # the preempted one gave its slot back and took one again
    assert all(s.is_finished and s.state_slot == -1 for s in seqs)
    assert bm.num_free_slots == 4 and bm.num_free_pages == 5


def test_a_sequence_without_a_free_slot_waits():
    import random

    bm = hybrid(num_slots=1, prefix=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, steps_per_call=4)
    a, b = seq(5, "a"), seq(5, "b")
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [e.seq for e in plan.entries] == [a] and a.state_slot == 0
    assert b.state_slot == -1 and b.block_table == [] and list(sched.waiting) == [b]
    device = FakeDevice(sched, random.Random(1))
    device.run(plan)
    plans = drive(sched, device)
    assert all(len(p.entries) == 1 for p in plans)  # one slot: one sequence at a time, never a crash
    assert a.is_finished and b.is_finished and bm.num_free_slots == 1 and bm.num_free_pages == 64


def test_abort_part_way_through_a_chunked_prefill_frees_the_slot():
    bm = hybrid(num_slots=2, prefix=False)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=4)
    s = seq(10)
    sched.add(s)
    sched.schedule()  # first chunk: s holds a page and a slot but is still waiting
    assert s.status is SequenceStatus.WAITING and s.block_table and s.state_slot >= 0
    sched.finish(s, "abort")
    assert bm.num_free_pages == 64 and bm.num_free_slots == 2 and s.state_slot == -1


def test_calls_end_at_snapshot_points():
    """Every `interval` pages and at the prompt's last page boundary before its last token, a prompt
    chunk ends and a decode row stops; the state there is snapshotted, copied before the next call."""
    bm = hybrid(num_slots=2, num_snapshot_slots=2, interval=2)  # points every 8 tokens
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, steps_per_call=8)
    s = seq(14)  # the prompt's point: 12, its 13 first tokens are what an equal prompt can reuse
    sched.add(s)
    chunks = []
    for _ in range(3):
        plan = sched.schedule()
        e = plan.entries[0]
        chunks.append((e.start, e.num_tokens, e.sample, plan.slot_copies))
        if e.sample:
            s.output_token_ids.append(7)
        sched.update_from_output(plan, [int(e.sample)])
    slot = s.state_slot
    first, second = range(2, 4)  # snapshot slots are numbered after the live ones
    assert chunks == [(0, 8, False, []), (8, 4, False, [[(slot, first)]]), (12, 2, True, [[(slot, second)]])]
    assert bm.num_snapshots == 2
    plan = sched.schedule()  # 15 tokens, 14 computed: two steps reach the point at 16
    assert plan.kind == "decode" and plan.entries[0].max_steps == 2 and plan.slot_copies == []
    s.output_token_ids += [7, 7]
    sched.update_from_output(plan, [2])
    plan = sched.schedule()
    assert plan.entries[0].max_steps == 8 and plan.slot_copies == [[(slot, first)]]  # the oldest snapshot goes
    sched.finish(s, "abort")


def test_prompts_cut_at_snapshot_points_still_start_together():
    """A prompt that stops at a snapshot point holds its whole prompt's pages and lets the next
    one start in the same step; the budget still cuts only the last."""
    bm = hybrid(num_slots=8, num_snapshot_slots=8, interval=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=20)
    a, b, c = (Sequence(name, [base + i for i in range(14)], SamplingParams(max_tokens=4))
               for name, base in (("a", 0), ("b", 100), ("c", 200)))
    for s in (a, b, c):
        sched.add(s)
    steps = []
    while sched.waiting:
        plan = sched.schedule()
        steps.append([(e.seq.request_id, e.start, e.num_tokens, len(e.seq.block_table))
                      for e in plan.entries[:plan.num_prefill]])
        for e in plan.entries:
            if e.sample:
                e.seq.output_token_ids.append(7)
        sched.update_from_output(plan, [int(e.sample) for e in plan.entries])
    # a and b stop at 8 with pages for all 14 tokens, c at the budget with pages for 4
    assert steps[0] == [("a", 0, 8, 4), ("b", 0, 8, 4), ("c", 0, 4, 1)]
    steps = [[entry[:3] for entry in step] for step in steps]
    assert steps[1] == [("a", 8, 4), ("b", 8, 4), ("c", 4, 4)]
    assert steps[2] == [("a", 12, 2), ("b", 12, 2), ("c", 8, 4)]
    assert steps[3] == [("c", 12, 2)] and len(steps) == 4
    assert bm.num_snapshots == 6  # each prompt's state at 8 and at 12


def test_without_snapshots_calls_are_not_cut():
    for bm in (hybrid(prefix=False), BlockManager(64, 4)):
        sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, steps_per_call=8)
        s = seq(14)
        sched.add(s)
        plan = sched.schedule()
        assert (plan.entries[0].num_tokens, plan.slot_copies) == (14, [])
        s.output_token_ids.append(7)
        sched.update_from_output(plan, [1])
        assert sched.schedule().entries[0].max_steps == 8


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """As if a call computed s's first n tokens (and the runner made the queued copies)."""
    bm.allocate(s, max(n, s.num_tokens))
    s.num_computed_tokens = n
    bm.cache_full_pages(s)
    bm.snapshot(s)


def test_a_prefix_hit_needs_a_snapshot_of_the_state_where_it_ends():
    bm = hybrid(num_pages=32, num_slots=3, num_snapshot_slots=2, interval=100)
    a = seq(11, "a")
    computed(bm, a, 8)  # the prompt's point: 8 (its last token is 10)
    assert bm.take_copies() == [[(a.state_slot, 3)]]
    computed(bm, a, 11)
    bm.free(a)
    b = seq(11, "b")
    assert bm.match_prefix(b) == 8 and b.state_slot >= 0 and bm.prefix_hits == 8
    assert bm.take_copies() == [[(3, b.state_slot)]]  # the snapshot into b's own slot
    longer = seq(13, "longer")  # pages 0..2 are usable, but the state is known after 2 only
    assert bm.match_prefix(longer) == 8
    bm.take_copies()
    first_page_only = Sequence("c", [0, 1, 2, 3, 9, 9, 9, 9, 9], SamplingParams())
    free_pages = bm.num_free_pages
    assert bm.match_prefix(first_page_only) == 0  # its page is cached, the state after it is not
    assert first_page_only.state_slot == -1 and first_page_only.block_table == []
    assert bm.num_free_pages == free_pages and bm.take_copies() == []
    no_slot = seq(11, "d")  # b and longer hold two of the three slots; c takes the last
    bm.allocate(first_page_only, 9)
    assert bm.match_prefix(no_slot) == 0 and no_slot.state_slot == -1  # no slot: no hit, it waits
    for s in (b, longer, first_page_only):
        bm.free(s)
    assert bm.num_free_slots == 3 and bm.num_free_pages == 32
    dense = BlockManager(32, 4)  # without recurrent state the same pages hit without a snapshot
    x = seq(11, "x")
    dense.allocate(x, 11)
    x.num_computed_tokens = 11
    dense.free(x)
    assert dense.match_prefix(Sequence("y", [0, 1, 2, 3, 9, 9, 9, 9, 9], SamplingParams())) == 4


def test_snapshots_are_evicted_least_recently_used_first():
    bm = hybrid(num_pages=64, num_slots=1, num_snapshot_slots=2, interval=100)
    prompts = {name: [base + i for i in range(9)] for name, base in (("a", 0), ("b", 100), ("c", 200))}

    def run(name: str) -> int:
        s = Sequence(name, prompts[name], SamplingParams())
        hit = bm.match_prefix(s)
        computed(bm, s, 8)
        bm.take_copies()
        bm.free(s)
        return hit

    assert [run("a"), run("b"), run("a")] == [0, 0, 8]  # the hit makes a's snapshot the most recent
    assert run("c") == 0  # evicts b's, the least recently used
    assert [run("a"), run("b")] == [8, 0]
    assert bm.num_snapshots == 2


def test_slot_copies_run_in_waves_that_keep_their_order():
    """A snapshot taken after a call and a hit on it before the next call: the hit reads what the
    snapshot writes, so it runs in a later wave. Overwriting a slot another copy reads shares a wave."""
    bm = hybrid(num_pages=64, num_slots=2, num_snapshot_slots=1, interval=100)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    a = seq(9, "a")
    sched.add(a)
    plan = sched.schedule()
    assert plan.entries[0].num_tokens == 8  # up to the prompt's point
    sched.update_from_output(plan, [0])  # queues a.slot -> 2
    sched.finish(a, "abort")  # a's slot goes back; the queued snapshot still reads it first
    b = seq(9, "b")
    sched.add(b)
    plan = sched.schedule()
    assert b.num_computed_tokens == 8 and plan.entries[0].start == 8
    assert plan.slot_copies == [[(0, 2)], [(2, b.state_slot)]]
    other = Sequence("c", [50 + i for i in range(9)], SamplingParams())
    sched.add(other)
    plan = sched.schedule()  # c's first chunk ends at its prompt's point
    sched.update_from_output(plan, [0] * len(plan.entries))
    d = seq(9, "d")  # a hit on b's prefix would read slot 2, which c's snapshot overwrote: gone
    assert bm.match_prefix(d) == 0
    bm._copies = [(2, 0), (1, 2), (0, 1)]  # read 2, overwrite 2 (same wave); read 0, written before: next
    assert bm.take_copies() == [[(2, 0), (1, 2)], [(0, 1)]]


def sibling_requests(rng, count: int) -> list:
    """`count` random requests as (sequence, abort?) for `random_traffic`: shared prefixes, 20%
    with n = 2 siblings, 20% of sequences marked for abort."""
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    pending = []
    for i in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        params = SamplingParams(max_tokens=rng.randrange(1, 14))
        for index in range(2 if rng.random() < 0.2 else 1):
            pending.append((Sequence(str(i), prompt, params, index=index), rng.random() < 0.2))
    pending.reverse()
    return pending


@pytest.mark.parametrize("prefix", [True, False])
def test_random_requests_keep_every_state_slot_right(prefix):
    """300 requests (shared prefixes, n = 2 siblings, aborts, host-side stops, preemption) on a fake
    device whose slots hold the tokens their state sums up: every row that continues from its slot
    finds exactly its own prefix there, and no slot or page leaks."""
    import random

    rng = random.Random(3)
    bm = hybrid(num_pages=20, num_slots=6, num_snapshot_slots=5, interval=2, prefix=prefix)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64, steps_per_call=3)
    device = FakeDevice(sched, rng)
    pending = sibling_requests(rng, 300)
    live = random_traffic(sched, pending, rng, device.run, check=lambda: assert_slots_consistent(sched))
    assert not pending and not sched.has_unfinished() and all(s.is_finished for s, _ in live)
    assert bm.num_free_pages == bm.num_pages and bm.num_free_slots == bm.num_slots
    assert device.continued > 0 and sched.num_preemptions > 0
    assert (bm.prefix_hits > 0 and bm.num_snapshots == 5) if prefix else (bm.prefix_hits == 0)


@pytest.mark.parametrize("caching", [True, False])
def test_n_siblings_wait_one_step_for_the_prompt_pages_then_start_together(caching):
    """n = 6 siblings of one prompt: with prefix caching the first computes the prompt, and the
    other five start together in the next step (each on the cached pages); without it, all six
    start at once (nothing to wait for). Before, the siblings started one per step."""
    sched = Scheduler(BlockManager(num_pages=64, page_size=4, enable_prefix_caching=caching), max_num_seqs=8,
                      max_num_batched_tokens=64)
    params = SamplingParams(n=6, max_tokens=4)
    siblings = [Sequence("r", list(range(10)), params, index=i) for i in range(6)]
    for s in siblings:
        sched.add(s)
    starts = []
    while sched.waiting:
        plan = sched.schedule()
        starts.append(sorted(e.seq.index for e in plan.entries[:plan.num_prefill]))
        for e in plan.entries:
            e.seq.num_computed_tokens = e.start + e.num_tokens
            if e.sample:
                e.seq.output_token_ids.append(1)
        sched.update_from_output(plan, [int(e.sample) for e in plan.entries])
    assert starts == ([[0], [1, 2, 3, 4, 5]] if caching else [[0, 1, 2, 3, 4, 5]])
    assert sched.block_manager.prefix_hits == (5 * 8 if caching else 0)  # two full prompt pages each


def test_warmup_plans_fit_one_sequence():
    """A token budget past the context (max_num_batched_tokens 2048, sequences of at most 512
    tokens) has no chunk longer than a sequence: its dummies fit the block tables
    (`weld serve --warmup full` crashed on a 513-token dummy)."""
    from weld.engine.batch import warmup_plans

    def longest(plans):
        return max(e.seq.num_tokens for p in plans for e in p.entries)

    assert longest(warmup_plans(8, 2048, 16, (3,))) > 512  # without the bound
    plans = warmup_plans(8, 2048, 16, (3,), max_seq_len=512)
    assert longest(plans) <= 512
    assert {p.kind for p in plans} == {"decode", "verify", "prefill", "mixed"}
