"""AsyncLLM: concurrent streams, abort mid-stream, shutdown."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

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


def _stream(engine, prompt, params, request_id, stream=True):
    async def main():
        return [out async for out in engine.generate(prompt, params, request_id=request_id, stream=stream)]
    return asyncio.run(main())


def _growth(outputs, index=0):
    counts = [len(next(c for c in o.outputs if c.index == index).token_ids) for o in outputs]
    return [b - a for a, b in zip(counts, counts[1:])]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_streamed_request_gets_each_token_as_it_is_sampled(engine, tiny_llama_dir, logprobs):
    """steps_per_call is 4: outputs one token apart can only come from inside the device calls."""
    params = SamplingParams(max_tokens=19, temperature=0.7, seed=3, ignore_eos=True, logprobs=logprobs)
    streamed = _stream(engine, "The quick brown fox", params, "tok")
    assert _growth(streamed) == [1] * 18
    per_call = _stream(engine, "The quick brown fox", params, "call", stream=False)
    assert max(_growth(per_call)) == 4  # unstreamed: one output per call
    assert streamed[-1].outputs == per_call[-1].outputs  # same tokens, text and logprobs either way
    texts = [o.outputs[0].text for o in streamed]
    assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:]))
    stats = engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"] and stats["running"] == 0


def test_a_stop_string_met_inside_a_call_ends_the_stream_there(engine, tiny_llama_dir):
    directory, _ = tiny_llama_dir
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    text = _stream(engine, "Once upon a time", greedy, "free")[-1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], n=2)
    streamed = _stream(engine, "Once upon a time", params, "stop")
    offline = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01, steps_per_call=4).generate(
        ["Once upon a time"], params)[0]
    assert streamed[-1].finished and streamed[-1].outputs == offline.outputs
    assert [c.finish_reason for c in streamed[-1].outputs] == ["stop", "stop"]
    assert all(stop not in o.outputs[0].text for o in streamed)  # never shown past the stop, even mid-call
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize("hand_over", ["native", "callback"])
def test_stream_interval_groups_tokens(tiny_llama_dir, monkeypatch, hand_over):
    """Both ways out of the loop (`weld.engine.streaming`): the native mailbox, and the Python
    callback that runs where the native kernels do not (here: turned off)."""
    directory, _ = tiny_llama_dir
    monkeypatch.setenv("WELD_CPU_KERNELS", "1" if hand_over == "native" else "0")
    eng = AsyncLLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01, steps_per_call=8,
                   stream_interval=3)
    assert eng.engine.runner._native_stream == (hand_over == "native")
    try:
        streamed = _stream(eng, "def add(a, b):", SamplingParams(max_tokens=25, temperature=0, ignore_eos=True), "iv")
    finally:
        eng.shutdown()
    # calls of 8 steps hand over after steps 3 and 6, the call's end brings the rest
    assert _growth(streamed) == [3, 3, 2] * 3


def test_the_streaming_programs_stay_in_the_compile_cache(tiny_llama_dir, tmp_path):
    """JAX keeps a program holding a Python callback out of its persistent cache: the native
    hand-over must not be one, or every start would compile the decode programs again."""
    directory, _ = tiny_llama_dir
    code = ("import sys; from weld import LLM, SamplingParams; "
            "LLM(sys.argv[1], max_model_len=128, kv_cache_memory_gb=0.01).generate(['hi'], "
            "SamplingParams(max_tokens=12, temperature=0))")
    env = {**os.environ, "WELD_CACHE_DIR": str(tmp_path), "WELD_CPU_KERNELS": "1"}
    subprocess.run([sys.executable, "-c", code, str(directory)], env=env, check=True, timeout=300,
                   capture_output=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("jit_decode-")]


def test_speculative_rounds_stream_as_they_are_verified(tiny_llama_dir):
    """Each verification round's accepted tokens go out when the round ends, not at the call's."""
    directory, _ = tiny_llama_dir
    eng = AsyncLLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01, steps_per_call=4,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
                   enable_prefix_caching=False)  # a cached prefix moves logprobs by ~1e-5: compare exactly
    prompt = "one two three four one two three four one two three four one two"
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    try:
        streamed = _stream(eng, prompt, params, "spec")
        per_call = _stream(eng, prompt, params, "spec-call", stream=False)
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert streamed[-1].outputs == per_call[-1].outputs
    assert len(streamed) > len(per_call)
    assert max(_growth(streamed)) <= 4  # a round emits at most its 3 drafts and one more token
    assert stats["spec_num_accepted_tokens"] > 0 and stats["running"] == 0


def test_llm_stream_hands_each_token_to_on_text_and_holds_back_a_stop_string(tiny_llama_dir):
    """The CLI's path: `LLM.stream(on_text=...)` gets tokens from inside the device calls."""
    directory, _ = tiny_llama_dir
    llm = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01, steps_per_call=4)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(["Once upon a time"], greedy)[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    for params, expected in ((greedy, full), (SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                             stop=[stop]), full[:full.index(stop)])):
        events = []
        for delta in llm.stream("Once upon a time", params, on_text=lambda d: events.append(("call", d))):
            events.append(("end", delta))
        assert "".join(d for _, d in events) == expected
        assert sum(kind == "call" for kind, _ in events) >= len(events) // 2  # most came from inside the calls
    per_call = list(llm.stream("Once upon a time", greedy))
    assert "".join(per_call) == full and len(per_call) <= 8  # without on_text: one piece per call
