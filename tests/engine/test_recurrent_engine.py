"""A hybrid model (tiny Qwen3-Next: Gated DeltaNet layers between full-attention layers) through the
engine: recurrent-state slots under continuous batching, chunked prefill, preemption and aborts;
prefix-cache hits through state snapshots; speculative verification rolled back to the accepted
tokens. Greedy outputs must be those of plain one-shot generation (HF's, and the engine's own with
the feature off), and no slot or page may leak."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest
import torch

from reference_drafts import ReferenceProposer

from weld import LLM, SamplingParams
from weld.engine import programs
from weld.engine.block_manager import SNAPSHOT_INTERVAL, BlockManager
from weld.engine.llm import MIN_SNAPSHOT_SLOTS
from weld.models.common.cache import CacheSpec, PagedKV, Recurrent
from weld.utils.errors import InvalidInputError

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):", "Paris is the capital of France. Paris is",
           "Once upon a time"]
NEW_TOKENS = 10
ENGINE = dict(dtype="float32", max_model_len=96, page_size=4, kv_cache_memory_gb=0.004, max_num_seqs=4,
              steps_per_call=4, progress=False)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_family_dir):
    return tiny_family_dir("qwen3_next")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model[0]), **ENGINE)


@pytest.fixture(scope="module")
def batched(llm):
    """The greedy outputs of PROMPTS run together, with the prefix cache still empty."""
    return ids(llm.generate(PROMPTS, GREEDY))


def ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"], stats
    assert stats["num_free_state_slots"] == stats["num_state_slots"] > 0, stats
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()


def like(bm: BlockManager, **changes) -> BlockManager:
    """A new block manager with bm's settings (slot ids included: the runner's cache has them all)."""
    settings = dict(num_pages=bm.num_pages, page_size=bm.page_size, enable_prefix_caching=bm.enable_prefix_caching,
                    num_slots=bm.num_slots, num_snapshot_slots=bm.num_snapshot_slots,
                    snapshot_interval=bm.snapshot_interval)
    return BlockManager(**{**settings, **changes})


class swapped_block_manager:
    """Runs the engine on another block manager, then on a fresh one like the first: the pages and
    snapshot slots the first one had cached were overwritten meanwhile."""

    def __init__(self, llm: LLM, **changes):
        self.scheduler = llm.engine.scheduler
        self.roomy = self.scheduler.block_manager
        self.bm = like(self.roomy, **changes)

    def __enter__(self) -> BlockManager:
        self.scheduler.block_manager = self.bm
        return self.bm

    def __exit__(self, *exc) -> None:
        self.scheduler.block_manager = like(self.roomy)


def hf_greedy(model, token_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def test_continuous_batching_equals_each_prompt_alone_and_hf(llm, model, batched):
    for prompt, tokens in zip(PROMPTS, batched):
        assert tokens == hf_greedy(model[1], llm.tokenizer.encode(prompt), NEW_TOKENS), prompt
    llm.engine.block_manager.enable_prefix_caching = False  # alone, and computed from scratch
    try:
        assert [ids(llm.generate(p, GREEDY))[0] for p in PROMPTS] == batched
    finally:
        llm.engine.block_manager.enable_prefix_caching = True
    assert_no_leaks(llm)


def test_arrivals_mid_flight_and_chunked_prefill_keep_outputs(llm, batched):
    """Prompts in chunks of at most 5 tokens, mixed with the other rows' decode steps, arriving
    one step after another (prefix caching off: everything is computed)."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, 5
    engine.block_manager.enable_prefix_caching = False
    finished = {}
    try:
        pending = list(enumerate(PROMPTS))
        while pending or engine.has_unfinished():
            if pending:
                i, prompt = pending.pop()
                engine.add_request(f"late{i}", llm.tokenizer.encode(prompt), GREEDY)
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        scheduler.max_num_batched_tokens = budget
        engine.block_manager.enable_prefix_caching = True
    assert [list(finished[f"late{i}"].outputs[0].token_ids) for i in range(len(PROMPTS))] == batched
    assert_no_leaks(llm)


def test_prefix_cache_hits_restore_the_state_and_keep_outputs(llm, batched):
    """The same prompts again hit their prompt snapshots; a follow-up prompt that extends a first
    prompt and its output hits a snapshot taken while decoding (every 2 pages here), past the prompt."""
    bm = llm.engine.block_manager
    bm.snapshot_interval = 2
    try:
        first = [ids(llm.generate(p, GREEDY))[0] for p in PROMPTS]  # snapshots along prompts and outputs
        hits = bm.prefix_hits
        assert ids(llm.generate(PROMPTS, GREEDY)) == batched == first
        assert bm.prefix_hits > hits and bm.num_snapshots > 0
        follow_ups = [{"prompt_token_ids": llm.tokenizer.encode(p) + out + llm.tokenizer.encode(" and then")}
                      for p, out in zip(PROMPTS, batched)]
        cached = []
        for prompt, follow_up in zip(PROMPTS, follow_ups):
            hits = bm.prefix_hits
            cached += ids(llm.generate(follow_up, GREEDY))
            assert bm.prefix_hits - hits > len(llm.tokenizer.encode(prompt)) - 1, prompt  # into the output
        bm.enable_prefix_caching = False
        try:
            assert ids(llm.generate(follow_ups, GREEDY)) == cached
        finally:
            bm.enable_prefix_caching = True
    finally:
        bm.snapshot_interval = SNAPSHOT_INTERVAL
    assert_no_leaks(llm)


def test_n_siblings_reuse_the_first_ones_prompt_snapshot(llm):
    bm = llm.engine.block_manager
    prompt = PROMPTS[2] + " Rome is"  # a prompt nothing has cached
    bm.enable_prefix_caching = False  # (nor will this)
    try:
        alone = ids(llm.generate(prompt, GREEDY))[0]
    finally:
        bm.enable_prefix_caching = True
    hits = bm.prefix_hits
    both = llm.generate(prompt, SamplingParams(n=2, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))[0]
    assert bm.prefix_hits > hits  # the second sibling started from the first one's prompt snapshot
    assert [list(c.token_ids) for c in both.outputs] == [alone, alone]
    sampled = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=7)
    first, second = (llm.generate(PROMPTS[1], sampled)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]  # seeded
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert_no_leaks(llm)


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_by_recompute_keeps_outputs(llm, batched, prefix):
    """A pool too small for all rows at once: the newest is preempted (its slot freed) and
    recomputed from position 0, or from a snapshot hit with prefix caching."""
    page = llm.engine.block_manager.page_size
    needs = [-(-(len(llm.tokenizer.encode(p)) + NEW_TOKENS) // page) for p in PROMPTS]
    preemptions = llm.engine.scheduler.num_preemptions
    with swapped_block_manager(llm, num_pages=max(needs) + 1, enable_prefix_caching=prefix) as bm:
        assert ids(llm.generate(PROMPTS, GREEDY)) == batched
        assert llm.engine.scheduler.num_preemptions > preemptions
        assert bm.num_free_pages == bm.num_pages and bm.num_free_slots == bm.num_slots
        assert (bm.prefix_hits > 0) == prefix


def test_one_state_slot_runs_one_sequence_at_a_time(llm, batched):
    with swapped_block_manager(llm, num_slots=1, enable_prefix_caching=False) as bm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert ids(outs) == batched and bm.num_free_slots == 1


def test_random_traffic_with_aborts_leaks_no_slot_or_page(llm):
    rng = random.Random(0)
    engine, vocab = llm.engine, llm.cfg.vocab_size
    shared = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 14))] for _ in range(3)]
    pending = [(f"t{i}", rng.choice(shared) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 8))],
                SamplingParams(max_tokens=rng.randrange(1, 10), temperature=rng.choice([0, 1.0]), seed=i,
                               n=rng.choice([1, 1, 2])))
               for i in range(24)]
    aborted, started, finished = set(), set(), set()
    for _ in range(2000):
        for _ in range(rng.randrange(3)):
            if pending:
                engine.add_request(*pending.pop())
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                finished.add(out.request_id)
        for request_id in sorted(started - finished - aborted):
            if rng.random() < 0.1:
                aborted.add(request_id)
                engine.abort(request_id)
        if not pending and not engine.has_unfinished():
            break
    assert aborted and not pending
    assert_no_leaks(llm)


def test_speculative_verification_equals_plain_greedy(model, llm, batched, monkeypatch):
    """Verification feeds the last token and the drafts; where a draft is rejected the state is
    recomputed from before the forward over the tokens kept. n-gram drafts from prompts that
    repeat a phrase (this random model rejects them all), then drafts partly right."""
    spec = LLM(str(model[0]), **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                  "adaptive": False})
    assert ids(spec.generate(PROMPTS, GREEDY)) == batched
    rng = random.Random(0)
    phrases = [[rng.randrange(3, llm.cfg.vocab_size) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    repeats = [{"prompt_token_ids": (phrase * 6)[:rng.randrange(12, 40)]} for phrase in phrases]
    assert ids(spec.generate(repeats, GREEDY)) == ids(llm.generate(repeats, GREEDY))
    stats = spec.engine.spec_stats()
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    # the host drafts for every row (as it does for grammar-constrained ones): the reference drafts
    spec.engine.proposer = ReferenceProposer(prompts, batched, llm.cfg.vocab_size)
    monkeypatch.setattr(spec.engine.runner, "drafter", None)
    before = stats["spec_num_accepted_tokens"]
    assert ids(spec.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == batched
    stats = spec.engine.spec_stats()
    assert stats["spec_num_accepted_tokens"] - before >= 2 * len(PROMPTS)
    assert_no_leaks(spec)


def test_full_warmup_covers_every_program(model, keep_programs):
    small = LLM(str(model[0]), **{**ENGINE, "max_num_seqs": 2, "max_num_batched_tokens": 16})
    keep_programs(small.engine.runner)
    small.warmup(full=True)
    compiled = small.engine.runner.num_compiles
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0] * 3]  # hits (slot copies), and a prompt in chunks
    outs = small.generate(prompts, GREEDY)
    assert small.engine.block_manager.prefix_hits > 0
    assert ids(outs)[0] == ids(outs)[1]
    assert small.engine.runner.num_compiles == compiled, "a program shape outside the warm-up set"
    assert_no_leaks(small)


def test_the_recurrent_state_comes_out_of_the_kv_budget(model, llm):
    runner, bm = llm.engine.runner, llm.engine.block_manager
    spec = runner.family.cache_spec(llm.cfg)
    assert bm.num_slots == ENGINE["max_num_seqs"] and bm.num_snapshot_slots >= MIN_SNAPSHOT_SLOTS
    assert runner.cache.num_slots == bm.num_slots + bm.num_snapshot_slots
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.cache))
    assert total <= ENGINE["kv_cache_memory_gb"] * (1 << 30)
    assert total > 0.9 * ENGINE["kv_cache_memory_gb"] * (1 << 30)  # the rest of the budget went to pages
    slot_bytes = spec.bytes_per_sequence()
    off = LLM(str(model[0]), **{**ENGINE, "enable_prefix_caching": False})
    assert off.engine.block_manager.num_snapshot_slots == 0
    assert off.engine.stats()["num_pages"] > llm.engine.stats()["num_pages"]  # the snapshots' memory went to pages
    with pytest.raises(InvalidInputError, match="recurrent state"):
        LLM(str(model[0]), **{**ENGINE, "kv_cache_memory_gb": slot_bytes * 2 / (1 << 30)})


def test_a_hybrid_draft_model_is_refused(tiny_llama_dir, model):
    with pytest.raises(InvalidInputError, match="linear-attention"):
        LLM(str(tiny_llama_dir[0]), **ENGINE, speculative_config={"method": "draft_model", "model": str(model[0]),
                                                                  "num_speculative_tokens": 2})


def test_slot_copies_in_waves_read_each_source_before_a_later_wave_overwrites_it():
    """Device side of `BlockManager.take_copies`: a snapshot (live 0 -> snapshot 2) and a hit on
    it (2 -> live 1) must run as two waves; as one, the hit would read the old snapshot."""
    spec = CacheSpec((Recurrent(conv_channels=3, conv_width=3, state_shape=(2, 2)), PagedKV(1, 4)))
    copy = jax.jit(programs.copy_slots, donate_argnames=("cache",))

    def fresh():
        cache = spec.create(4, 4, np.float32, num_slots=3)
        values = np.arange(3, dtype=np.float32)[:, None, None] + 1  # slot i holds i + 1 everywhere
        layer = cache.layers[0]
        cache.layers[0] = type(layer)(conv=layer.conv + values, state=layer.state + values)
        return cache

    def slot(cache, i):
        return float(cache.layers[0].state[i, 0, 0]), float(cache.layers[0].conv[i, 0, 0])

    cache = fresh()
    for src, dst in ([[0], [2]], [[2], [1]]):
        cache = copy(cache, np.asarray(src, np.int32), np.asarray(dst, np.int32))
    assert slot(cache, 1) == slot(cache, 2) == (1.0, 1.0)
    one_wave = copy(fresh(), np.asarray([0, 2, -1, -1], np.int32), np.asarray([2, 1, -1, -1], np.int32))
    assert slot(one_wave, 1) == (3.0, 3.0)  # the stale snapshot: why a hit on it waits for the next wave
