"""Engine invariants under continuous batching, on a tiny random llama: outputs do not depend on
batch neighbours or arrival times, a warmed-up engine never recompiles, and random traffic with
aborts leaks no page."""

from __future__ import annotations

import random

import jax
import pytest

from weld import LLM, SamplingParams


@pytest.fixture(scope="module")
def warmed(tiny_llama_dir, keep_programs):
    """Small limits (4 rows, 32 tokens per step) keep the full shape set small enough to compile
    in seconds, and force chunked prefills, mixed steps and preemption."""
    directory, _ = tiny_llama_dir
    llm = LLM(model=str(directory), dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
              page_size=4, num_pages=48, steps_per_call=4, progress=False)
    keep_programs(llm.engine.runner)
    llm.warmup(full=True)
    return llm


class CompileCounter:
    """Counts XLA backend compiles (jax's monitoring events), whatever their origin."""

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if self.active and "backend_compile" in event:
            self.count += 1


@pytest.fixture(scope="module")
def compiles():
    return CompileCounter()


def random_params(rng: random.Random) -> SamplingParams:
    """Sampling settings that change no program shape: greedy or sampled, filters, seeds, stop strings."""
    kind = rng.randrange(3)
    common = dict(max_tokens=rng.randrange(1, 14), ignore_eos=rng.random() < 0.5)
    if kind == 0:
        return SamplingParams(temperature=0, **common)
    if kind == 1:
        return SamplingParams(temperature=rng.uniform(0.5, 1.5), top_k=rng.choice([0, 5, 40]),
                              top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                              seed=rng.randrange(1000), **common)
    return SamplingParams(temperature=0.8, stop=[rng.choice(["e", "th", "."])], **common)


def drive(llm: LLM, requests: list[tuple[str, list[int], SamplingParams]], rng: random.Random,
          abort_ids: set[str] = frozenset(), max_steps: int = 20000) -> dict[str, object]:
    """Feeds requests to the engine at random steps (0-3 arrivals per step), aborts the chosen
    ones at a random moment after they started, and returns every request's final output."""
    engine = llm.engine
    pending = list(requests)
    finished: dict[str, object] = {}
    started: set[str] = set()
    for _ in range(max_steps):
        for _ in range(rng.randrange(4)):
            if pending:
                request_id, ids, params = pending.pop(0)
                engine.add_request(request_id, ids, params)
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                finished[out.request_id] = out
        for request_id in sorted(abort_ids & started - finished.keys()):
            if rng.random() < 0.3:
                out = engine.abort(request_id)
                if out is not None:
                    finished[request_id] = out
        if not pending and not engine.has_unfinished():
            return finished
    raise AssertionError("the engine did not drain")


def random_prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 70))]  # up to 2+ chunks of 32


def test_warmed_up_engine_never_recompiles(warmed, compiles):
    rng = random.Random(0)
    vocab = warmed.cfg.vocab_size
    requests = [(f"r{i}", random_prompt(rng, vocab), random_params(rng)) for i in range(100)]
    before = warmed.engine.runner.num_compiles
    compiles.active = True
    try:
        outs = drive(warmed, requests, rng)
    finally:
        compiles.active = False
    assert len(outs) == 100 and all(o.finished for o in outs.values())
    assert warmed.engine.runner.num_compiles == before, "a program shape outside the warm-up set"
    assert compiles.count == 0
    stats = warmed.engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"]


def test_500_random_requests_with_aborts_leak_nothing(warmed):
    rng = random.Random(1)
    vocab = warmed.cfg.vocab_size
    shared = [random_prompt(rng, vocab)[:20] for _ in range(4)]  # common prefixes hit the cache
    requests = []
    for i in range(500):
        prompt = rng.choice(shared) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))]
        requests.append((f"q{i}", prompt, random_params(rng)))
    abort_ids = {r[0] for r in rng.sample(requests, 100)}
    hits = warmed.engine.stats()["prefix_cache_hits"]
    outs = drive(warmed, requests, rng, abort_ids)
    assert len(outs) == 500
    aborted = [o for o in outs.values() if o.outputs[0].finish_reason == "abort"]
    assert aborted and {o.request_id for o in aborted} <= abort_ids
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs.values() if o.request_id not in abort_ids)
    stats = warmed.engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"] and stats["running"] == stats["waiting"] == 0
    assert not warmed.engine.requests
    assert stats["prefix_cache_hits"] > hits


def test_greedy_output_does_not_depend_on_neighbours_or_arrival(tiny_llama_dir):
    """A request alone, and among 15 others of mixed lengths arriving at different steps (so it
    is prefilled in chunks, mixed with decodes, and decoded in fused calls of varying batch)."""
    directory, _ = tiny_llama_dir
    llm = LLM(model=str(directory), dtype="float32", max_model_len=128, max_num_seqs=16,
              max_num_batched_tokens=48, page_size=4, num_pages=400, steps_per_call=4, progress=False)
    rng = random.Random(2)
    vocab = llm.cfg.vocab_size
    target = [rng.randrange(3, vocab) for _ in range(40)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": target}, params)[0].outputs[0].token_ids
    others = [(f"o{i}", random_prompt(rng, vocab), SamplingParams(max_tokens=rng.randrange(4, 30), temperature=0))
              for i in range(15)]
    for position in (0, 7, 15):  # the target arrives first, in the middle, last
        requests = others[:position] + [("target", target, params)] + others[position:]
        outs = drive(llm, requests, random.Random(position))
        assert outs["target"].outputs[0].token_ids == alone, f"target arriving at {position}"
