"""LLM end to end on a tiny random llama (weights + tokenizer on disk), checked against HF."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from weld import LLM, SamplingParams
from weld.utils.errors import InvalidInputError

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time there was", "Paris"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    return LLM(model=str(directory), dtype="float32", max_model_len=128, kv_cache_memory_gb=0.01)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def assert_no_leaks(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages
    assert not llm.engine.requests


def test_greedy_matches_hf_and_batching(llm, tiny_llama_dir):
    _, hf_model = tiny_llama_dir
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 12), prompt
        alone = llm.generate(prompt, params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_prompt_logprobs_match_hf(llm, tiny_llama_dir):
    _, hf_model = tiny_llama_dir
    prompt = "Once upon a time there was a small model"
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, logprobs=3))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert ids[pos] in entry
        np.testing.assert_allclose(entry[ids[pos]].logprob, ref[pos - 1, ids[pos]], atol=1e-4)
        assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        top = sorted(((lp.rank, tid) for tid, lp in entry.items() if tid != ids[pos] or lp.rank <= 2))
        best = np.argsort(-ref[pos - 1])[:2].tolist()
        assert [tid for r, tid in top if r <= 2][:2] == best
    gen = out.outputs[0]
    lp = gen.logprobs[0][gen.token_ids[0]]
    np.testing.assert_allclose(lp.logprob, ref[-1].max(), atol=1e-4)  # greedy picks the argmax
    assert lp.rank == 1 and len(gen.logprobs[0]) == 3
    np.testing.assert_allclose(gen.cumulative_logprob, lp.logprob, atol=1e-6)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate("The quick brown fox", params)[0].outputs[0].token_ids
    b = llm.generate(["Paris", "The quick brown fox", "def add(a, b):"], params)[1].outputs[0].token_ids
    c = llm.generate("The quick brown fox", params.clone(seed=99))[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_n_completions_differ_and_share_prompt(llm):
    out = llm.generate("Once upon", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_no_leaks(llm)


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("The quick brown fox", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    text = base.outputs[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = llm.generate("The quick brown fox", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                             stop=[stop]))[0].outputs[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("The quick brown fox", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                              stop=stop, include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[:text.index(stop) + len(stop)]
    third = base.outputs[0].token_ids[2]
    by_id = llm.generate("The quick brown fox", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                               stop_token_ids=[third]))[0].outputs[0]
    first = base.outputs[0].token_ids.index(third)
    assert by_id.token_ids == base.outputs[0].token_ids[:first + 1] and by_id.stop_reason == third
    assert_no_leaks(llm)


def test_chunked_prefill_and_preemption_keep_outputs(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01).generate(PROMPTS, params)
    # 8 pages of 4 tokens cannot hold four growing sequences at once: the newest get preempted.
    small = LLM(model=str(directory), max_model_len=128, page_size=4, num_pages=12, max_num_batched_tokens=5)
    outs = small.generate(PROMPTS, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert_no_leaks(small)


def test_chat_uses_template(llm):
    messages = [{"role": "user", "content": "Paris"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0))[0]
    rendered = "<|im_start|>user\nParis<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("bad", [
    lambda llm: llm.generate("", SamplingParams()),
    lambda llm: llm.generate({"prompt_token_ids": []}, SamplingParams()),
    lambda llm: llm.generate({"prompt_token_ids": [1, 10 ** 6]}, SamplingParams()),
    lambda llm: llm.generate({"prompt_token_ids": [5] * 128}, SamplingParams()),
    lambda llm: llm.generate(["ok", 3], SamplingParams()),
    lambda llm: SamplingParams(temperature=-1),
    lambda llm: SamplingParams(top_p=0),
    lambda llm: SamplingParams(max_tokens=-1),
    lambda llm: SamplingParams(logprobs=21),
    lambda llm: SamplingParams(presence_penalty=3),
    lambda llm: SamplingParams(repetition_penalty=0),
    lambda llm: SamplingParams(logit_bias={"x": 1}),
    lambda llm: SamplingParams(logit_bias={5: 1000}),
    lambda llm: SamplingParams(min_tokens=5, max_tokens=2),
])
def test_bad_input_is_a_clear_error_and_leaks_nothing(llm, bad):
    with pytest.raises(InvalidInputError) as err:
        bad(llm)
    assert str(err.value) and "\n" not in str(err.value)
    assert_no_leaks(llm)
    assert llm.generate("Paris", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


def test_max_tokens_zero_returns_prompt_logprobs_only(llm):
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert_no_leaks(llm)


def test_growing_sequences_do_not_recompile(llm, keep_programs):
    """Block tables have a fixed width and attention loops over the pages in use, so longer
    sequences (more pages) reuse the same programs; only new batch/token buckets compile."""
    keep_programs(llm.engine.runner)
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=20, seed=1, ignore_eos=True)
    llm.generate(PROMPTS, params)
    before = llm.engine.runner.num_compiles
    longer = SamplingParams(max_tokens=60, temperature=0.7, top_k=20, seed=1, ignore_eos=True)  # ~17 pages of 4
    outs = llm.generate([p + " again" for p in PROMPTS], longer)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert llm.engine.runner.num_compiles == before


def test_prefix_cache_hits_and_keeps_outputs(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    shared = "Once upon a time there was a small model that wrote tests. The quick brown fox jumps over"
    prompts = [shared + " the lazy dog", shared + " Paris", shared + " def add(a, b):"]
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=4, ignore_eos=True)
    cold = LLM(model=str(directory), max_model_len=128, page_size=4, kv_cache_memory_gb=0.01,
               enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(model=str(directory), max_model_len=128, page_size=4, kv_cache_memory_gb=0.01)
    first = llm.generate(prompts[:1], params)
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    rest = llm.generate(prompts[1:], params)
    again = llm.generate(prompts[:1], params)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > hits_before + 2 * 8  # the shared prefix spans many 4-token pages
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == [o.outputs[0].token_ids for o in cold]
    assert again[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
    assert_no_leaks(llm)


def test_prompt_logprobs_bypass_the_prefix_cache(llm):
    prompt = "Once upon a time there was a small model that wrote tests again and again"
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert len(second.prompt_logprobs) == len(second.prompt_token_ids)
    assert [p and list(p.values())[0].logprob for p in first.prompt_logprobs] == \
        [p and list(p.values())[0].logprob for p in second.prompt_logprobs]


def test_n_completions_share_prompt_pages(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    llm = LLM(model=str(directory), max_model_len=128, page_size=4, kv_cache_memory_gb=0.01)
    prompt = "Once upon a time there was a small model that wrote tests."
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True))[0]
    full_pages = (len(out.prompt_token_ids) - 1) // 4
    assert llm.engine.stats()["prefix_cache_hits"] == 2 * full_pages * 4  # both siblings reused the prompt
    assert len(out.outputs) == 3
    assert_no_leaks(llm)


def test_near_the_memory_map_limit_compiled_programs_are_dropped_and_come_back(tiny_llama_dir, monkeypatch, caplog):
    """Each XLA:CPU program holds hundreds of memory mappings; past vm.max_map_count the process
    dies in LLVM. Near it the runner drops its programs, and they recompile as they are used."""
    from weld.engine import runner as runner_module

    directory, _ = tiny_llama_dir
    llm = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01)
    params = SamplingParams(max_tokens=10, temperature=0)
    before = llm.generate(["The quick brown fox", "Paris"], params)
    runner = llm.engine.runner
    held, compiles = len(runner._programs), runner.num_compiles
    assert held > 0
    usage = runner_module.memory_maps()
    assert usage is not None and 0 < usage[0] < usage[1]  # this machine tells
    monkeypatch.setattr(runner_module, "memory_maps", lambda: (60_000, 65_530))
    with caplog.at_level("WARNING", logger="weld.engine"):
        after = llm.generate(["The quick brown fox", "Paris", "Once upon a time"], params)  # a new batch shape
    assert runner.num_evictions >= 1 and "vm.max_map_count" in caplog.text
    assert runner.num_compiles > compiles and len(runner._programs) < held + 2
    assert [o.outputs[0].token_ids for o in after[:2]] == [o.outputs[0].token_ids for o in before]


def test_each_new_program_hands_compile_temporaries_back(tiny_llama_dir, monkeypatch):
    """Compiling frees ~100 MB of temporaries that glibc keeps mapped (the bundled model's
    served resident set: 821 MB untrimmed against 651 trimmed), and JAX's tracing caches keep
    ~28 MB of jaxprs and lowered modules. The runner trims the heap after every program it
    compiles, and not on calls that reuse one; serving, it drops those caches once, on the first
    call after a run of compiles. The executables stay: the same shapes again neither trace nor
    compile anything."""
    from jax import monitoring

    from weld.engine import runner as runner_module

    directory, _ = tiny_llama_dir
    llm = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01)
    assert not llm.engine.runner.drop_traces  # an LLM keeps them (the next compiles reuse them)
    llm.engine.runner.drop_traces = True  # as `weld serve` sets it (server.app.warmup)
    trims, drops, events = [], [], []
    monkeypatch.setattr(runner_module, "release_free_memory", lambda: trims.append(llm.engine.runner.num_compiles))
    drop = runner_module.drop_tracing_caches
    monkeypatch.setattr(runner_module, "drop_tracing_caches",
                        lambda: (drops.append(llm.engine.runner.num_compiles), drop()))
    params = SamplingParams(max_tokens=6, temperature=0)
    llm.generate(["The quick brown fox"], params)
    compiled = llm.engine.runner.num_compiles
    assert compiled > 1 and trims[:compiled] == list(range(1, compiled + 1))
    assert drops in ([], [compiled])  # not between the compiles: once, on the first call after them
    listener = lambda event, secs, **kw: events.append(event)  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        llm.generate(["The quick brown cat"], params)  # the same shapes: no compile, no trim
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert llm.engine.runner.num_compiles == compiled and drops == [compiled]
    assert len(trims) == compiled + 1  # and once after the drop (what it freed goes back)
    assert not [e for e in events if e.startswith("/jax/core/compile/")], events  # the executables stayed


@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])
def test_the_xla_backend_takes_the_cache_layouts_xla_picks(tiny_llama_dir, tiny_family_dir, variant, monkeypatch):
    """`sharding.pool_layouts` "auto" (the XLA backend on a TPU, forced here on the CPU): the
    engine compiles one decode step with `Layout.AUTO` for the cache (`runner.auto_cache_layouts`),
    creates the cache in the layouts XLA picked, every program gives it back so, the cache is
    sized by those layouts' device bytes (`sharding.page_bytes`), and the greedy text is the
    plain engine's (Llama; Qwen3-Next: recurrent states beside the pools)."""
    from jax.experimental.layout import Format

    from weld.engine import runner as runner_lib
    from weld.models.common import sharding

    directory = tiny_llama_dir[0] if variant == "llama" else tiny_family_dir(variant)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_memory_gb=0.01, steps_per_call=4)
    plain = [o.outputs[0].token_ids for o in LLM(model=str(directory), **kwargs).generate(PROMPTS, params)]
    chosen, measured = [], []
    auto, page_bytes = runner_lib.auto_cache_layouts, sharding.page_bytes
    monkeypatch.setattr(sharding, "pool_layouts", lambda backend, mesh: "auto")
    monkeypatch.setattr(runner_lib, "auto_cache_layouts", lambda *a, **k: chosen.append(auto(*a, **k)) or chosen[-1])
    monkeypatch.setattr(sharding, "page_bytes", lambda *a, **k: measured.append(k["layout"]) or page_bytes(*a, **k))
    llm = LLM(model=str(directory), **kwargs)
    runner = llm.engine.runner
    assert len(chosen) == 1 and runner.cache_layouts is chosen[0]
    assert measured and all(m is not None for m in measured)  # sized by the chosen layouts
    placement = runner._cache_shardings
    leaves = jax.tree.leaves(placement)
    assert leaves and all(isinstance(p, Format) for p in leaves)
    assert [p.layout for p in leaves] == jax.tree.leaves(chosen[0])
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages
