"""Data-parallel attention's bookkeeping as plain Python: one block manager per rank, sequences
placed by load then prefix, preemption within a rank, and batch rows grouped by rank."""

import random

import numpy as np
import pytest

from tests.engine.test_scheduler import FakeDevice, random_traffic, sibling_requests
from weld.engine import batch
from weld.engine.block_manager import DataParallelBlockManager
from weld.engine.sampling_params import SamplingParams
from weld.engine.scheduler import Scheduler, ScheduledSeq, SchedulerOutput
from weld.engine.sequence import Sequence


def seq(tokens, rid: str = "r", max_tokens: int = 100) -> Sequence:
    tokens = list(range(tokens)) if isinstance(tokens, int) else list(tokens)
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens))


def test_sequences_are_placed_on_the_least_loaded_rank_with_local_page_ids():
    bm = DataParallelBlockManager(2, num_pages=6, page_size=4)
    seqs = [seq(9, str(i)) for i in range(4)]
    for s in seqs:
        bm.match_prefix(s)
        bm.allocate(s, 9)
    assert [s.dp_rank for s in seqs] == [0, 1, 0, 1]
    for r in range(2):  # each rank's pages are its own ids 0 .. 5, taken once each
        pages = [p for s in seqs if s.dp_rank == r for p in s.block_table]
        assert sorted(pages) == sorted(set(pages)) and all(0 <= p < 6 for p in pages) and len(pages) == 6
    assert bm.num_pages == 12 and bm.num_free_pages == 0
    assert not bm.can_allocate(seqs[0], 13)  # rank 0 is full, whatever rank 1 holds
    bm.free(seqs[1])
    assert seqs[1].dp_rank == -1 and bm.num_free_pages == 3
    assert not bm.can_allocate(seqs[0], 13)  # rank 1's free pages are of no use to rank 0
    late = seq(5, "late")
    bm.match_prefix(late)
    assert late.dp_rank == 1  # the rank with room and the fewest sequences


def test_a_prefix_breaks_ties_between_equally_loaded_ranks():
    bm = DataParallelBlockManager(2, num_pages=8, page_size=4)
    history = list(range(100, 113))
    first, other = seq(history, "a"), seq(9, "b")
    for s in (first, other):
        bm.match_prefix(s)
        bm.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
    assert (first.dp_rank, other.dp_rank) == (0, 1)
    bm.free(other)  # rank 1 now has the more free pages
    bm.free(first)
    turn = seq(history + [7, 8, 9], "a2")  # the chat's next turn: rank 0 holds its history
    assert bm.match_prefix(turn) == 12 and turn.dp_rank == 0
    assert bm.prefix_hits == 12


def test_preemption_takes_the_newest_sequence_of_the_same_rank():
    bm = DataParallelBlockManager(2, num_pages=4, page_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, steps_per_call=1)
    # b leaves rank 1 less room than rank 0, so c joins a there; d, the newest, goes to rank 1
    a, b, c, d = seq(7, "a"), seq(10, "b"), seq(7, "c"), seq(1, "d")
    for s in (a, b, c, d):
        sched.add(s)
    plan = sched.schedule()
    assert plan.kind == "prefill" and [s.dp_rank for s in (a, b, c, d)] == [0, 1, 0, 1]
    for _ in range(2):  # a and c grow into a third page each: rank 0 must give one of them up
        for e in plan.entries:
            e.seq.num_computed_tokens = e.start + e.num_tokens
            e.seq.output_token_ids.append(1)
        plan = sched.schedule()
    assert sched.num_preemptions == 1
    assert c in sched.waiting and all(s in sched.running for s in (a, b, d))  # rank 1's d untouched


def test_rows_are_grouped_by_rank():
    seqs = [seq(5, str(i)) for i in range(3)]
    for s, r in zip(seqs, (1, 0, 1)):
        s.dp_rank, s.block_tables = r, [[r * 10 + int(s.request_id)]]
    entries = [ScheduledSeq(s, 4, 1, sample=True) for s in seqs]
    size, rows = batch.rank_rows(entries, 2)
    assert (size, rows) == (4, [2, 0, 3])  # two rows per rank: rank 1's entries in rows 2 and 3
    assert batch.rank_rows(entries, 1) == (4, [0, 1, 2])
    host = batch.build(SchedulerOutput("decode", entries), max_pages_per_seq=8, vocab_size=16,
                       eos_ids=np.array([0], np.int32), num_ranks=2)
    assert host.rows == [2, 0, 3]
    assert list(host.block_tables[:, 0]) == [1, 0, 10, 12] and list(host.stop.max_steps) == [1, 0, 1, 1]
    mixed = SchedulerOutput("mixed", [ScheduledSeq(seqs[1], 0, 5, sample=True), entries[0], entries[2]],
                            num_prefill=1)
    host = batch.build(mixed, max_pages_per_seq=8, vocab_size=16, eos_ids=np.array([0], np.int32), num_ranks=2)
    assert host.rows == [0, 4, 5]  # prompt rows [0, 2) (rank 0's in row 0), rank 1's decode rows 4 and 5
    (_, p_pos, _, _, _), (_, d_pos, _, _, _) = host.groups
    assert list(p_pos[0, :5]) == list(range(5)) and list(p_pos[1]) == [-1] * 16
    assert list(d_pos[:, 0]) == [-1, -1, 4, 4]  # rank 0's decode rows are padding: they write nothing
    with pytest.raises(ValueError, match="rank 3"):
        seqs[0].dp_rank = 3
        batch.rank_rows(entries, 2)


def check_ranks(sched: Scheduler, bm: DataParallelBlockManager, max_per_rank: int) -> None:
    """Every sequence holding pages is on a rank whose pool gave them; no rank holds more than its share."""
    holders = [s for s in list(sched.running) + list(sched.waiting) if any(s.block_tables)]
    for r, sub in enumerate(bm.ranks):
        mine = [s for s in holders if s.dp_rank == r]
        assert len(mine) <= max_per_rank
        held = sum(p >= 0 for s in mine for p in s.block_table)
        assert held >= sub.pools[0].num_pages - len(sub.pools[0].free)  # shared prefix pages count once
        slots = [s.state_slot for s in mine if s.state_slot >= 0]
        # rank-major slot blocks (the state pools split over the ranks so): live, then snapshots
        block = r * sub.num_state_slots
        live = range(block, block + sub.num_slots)
        assert len(set(slots)) == len(slots) and all(x in live for x in slots)
        assert set(sub._snapshots) == set(range(block + sub.num_slots, block + sub.num_state_slots))


@pytest.mark.parametrize("hybrid", [False, True])
def test_random_requests_on_two_ranks_keep_pages_and_slots_right(hybrid):
    """300 requests (shared prefixes, n = 2 siblings, aborts, preemption) over 2 ranks; with
    recurrent state the fake device checks every continuing row finds exactly its prefix in its
    slot, across both ranks' slot ranges and merged copy waves."""
    rng = random.Random(5)
    bm = DataParallelBlockManager(2, num_pages=12, page_size=4, num_slots=3 if hybrid else 0,
                                  num_snapshot_slots=3 if hybrid else 0, snapshot_interval=2)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64, steps_per_call=3)
    device = FakeDevice(sched, rng) if hybrid else None
    pending = sibling_requests(rng, 300)
    shapes = []

    def run(plan):
        host_rows = batch.rank_rows(plan.entries[:plan.num_prefill] or plan.entries, 2)
        shapes.append(host_rows[0])
        assert len(set(host_rows[1])) == len(host_rows[1])
        if device is not None:
            device.run(plan)
            return
        new = []
        for e in plan.entries:  # no state to check: tokens only
            taken = 0
            if e.sample:
                for _ in range(rng.randint(1, e.max_steps)):
                    e.seq.output_token_ids.append(rng.randrange(50))
                    taken += 1
                    if e.seq.num_output_tokens >= e.seq.params.max_tokens:
                        e.seq.stop("length")
                        break
            new.append(taken)
        sched.update_from_output(plan, new)

    live = random_traffic(sched, pending, rng, run, check=lambda: check_ranks(sched, bm, 3))
    assert not pending and not sched.has_unfinished() and all(s.is_finished for s, _ in live)
    assert bm.num_free_pages == bm.num_pages and bm.num_free_slots == bm.num_slots
    assert sched.num_preemptions > 0 and bm.prefix_hits > 0
    assert max(shapes) <= 2 * 4  # each rank's share of a batch stays within bucket(3) rows
    if hybrid:
        assert device.continued > 0 and bm.num_snapshots > 0
