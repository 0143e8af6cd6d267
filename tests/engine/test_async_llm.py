"""AsyncLLM: concurrent streams, abort mid-stream, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from weld import LLM, SamplingParams
from weld.engine.async_llm import AsyncLLM

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time there was"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    eng = AsyncLLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01, steps_per_call=4)
    yield eng
    eng.shutdown()
    assert not eng._thread.is_alive()


def test_concurrent_streams_equal_offline(engine, tiny_llama_dir):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)

    async def collect(i, prompt):
        seen = []
        async for out in engine.generate(prompt, params, request_id=f"s{i}"):
            seen.append(out)
        return seen

    async def main():
        return await asyncio.gather(*(collect(i, p) for i, p in enumerate(PROMPTS)))

    streams = asyncio.run(main())
    directory, _ = tiny_llama_dir  # a separate offline engine: the async one belongs to its thread
    offline = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01).generate(PROMPTS, params)
    for seen, ref in zip(streams, offline):
        assert len(seen) > 1  # several increments, not one final blob
        texts = [s.outputs[0].text for s in seen]
        assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:]))  # cumulative
        assert seen[-1].finished and seen[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    stats = engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"]


def test_leaving_the_stream_aborts_and_frees_pages(engine):
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def main():
        agen = engine.generate("Once upon a time", params, request_id="quit")
        async for out in agen:
            assert not out.finished
            break
        await agen.aclose()

    asyncio.run(main())
    stats = engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"] and stats["running"] == stats["waiting"] == 0


def test_abort_ends_the_stream(engine):
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def main():
        last = None
        async for out in engine.generate("Paris", params, request_id="ab"):
            last = out
            if len(out.outputs[0].token_ids) >= 4:
                await engine.abort("ab")
        return last

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 100


def test_bad_request_raises_in_the_caller(engine):
    async def main():
        async for _ in engine.generate("", SamplingParams(), request_id="bad"):
            pass

    with pytest.raises(Exception, match="empty"):
        asyncio.run(main())
    assert engine.is_running
