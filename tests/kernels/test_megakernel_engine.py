"""`backend="megakernel"` in the engine: the fused decode loop runs the megakernel (Pallas TPU
interpret mode on CPU) and must produce the XLA backend's greedy text."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from reference_drafts import ReferenceProposer

from weld import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris"]


def _llm(directory, backend, quantization=None):
    return LLM(model=str(directory), dtype="float32", max_model_len=64, kv_cache_memory_gb=0.01, steps_per_call=4,
               backend=backend, quantization=quantization)


@pytest.mark.slow
def test_megakernel_backend_greedy_text_matches_xla(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    xla = _llm(directory, "xla").generate(PROMPTS, params)
    mega_llm = _llm(directory, "megakernel")
    mega = mega_llm.generate(PROMPTS, params)
    for a, b in zip(xla, mega):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
    from weld.models import megakernel

    # the decode program really is the megakernel's (equal text alone would not prove it ran)
    assert mega_llm.engine.runner._decode.__wrapped__.args[0] is megakernel.forward
    bm = mega_llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_megakernel_takes_weights_quantized_at_load(tiny_llama_dir):
    """quantization "int8_channel": the matrices and the LM head are quantized once, at load, and
    the kernel's operands are those arrays themselves (nothing is quantized inside a call)."""
    from weld.models import megakernel
    from weld.models.common import quant

    llm = _llm(tiny_llama_dir[0], "megakernel", quantization="int8_channel")
    weights = llm.model.weights
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    assert all(quant.is_quantized(lw[n]) and lw[n].fmt == "int8_channel" for lw in weights["layers"] for n in names)
    params = megakernel.kernel_params(llm.cfg, weights)
    assert params["layers"][0]["q"].q is weights["layers"][0]["wq"].codes
    assert params["lm_head"].scale is weights.get("lm_head", weights["embed"]).scales
    assert not quant.is_quantized(params["embed"])  # the rows the kernel fetches are floats


@pytest.mark.slow
def test_megakernel_int8_greedy_text_matches_xla_int8(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    xla = _llm(directory, "xla", "int8_channel").generate(PROMPTS, params)
    mega = _llm(directory, "megakernel", "int8_channel").generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in mega] == [o.outputs[0].token_ids for o in xla]


def test_backend_switch_picks_the_decode_forward():
    import dataclasses

    from weld.engine.runner import decode_forward
    from weld.models import llama
    from weld.models import megakernel

    cfg = llama.Config(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8)
    assert decode_forward(llama, cfg, "xla") is llama.forward
    assert decode_forward(llama, cfg, "megakernel") is megakernel.forward
    with pytest.raises(ValueError, match=r"backend must be one of \('xla', 'megakernel'\), got 'cuda'"):
        decode_forward(llama, cfg, "cuda")
    assert decode_forward(llama, dataclasses.replace(cfg, sliding_window=8), "megakernel") is megakernel.forward


def test_cli_backend_flag():
    from weld.cli import build_parser

    parser = build_parser()
    for command in (["serve"], ["generate", "hi"], ["chat"]):
        assert parser.parse_args(command).backend == "xla"
        assert parser.parse_args(command + ["--backend", "megakernel"]).backend == "megakernel"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--backend", "cuda"])


def test_what_the_megakernel_does_not_cover_is_a_one_line_input_error(tiny_family_dir, monkeypatch):
    """Every family runs on the kernel today: a family taken off its list stands for the next one
    that will not (the adapter's refusal reaches the user as one line, before any weight loads)."""
    from weld.models import gpt_oss, megakernel
    from weld.utils.errors import InvalidInputError

    monkeypatch.setattr(megakernel, "FAMILIES", tuple(f for f in megakernel.FAMILIES if f is not gpt_oss.Config))
    with pytest.raises(InvalidInputError, match="the megakernel runs the llama, .* got a weld.models.gpt_oss") as err:
        LLM(str(tiny_family_dir("gpt_oss")[0]), backend="megakernel", max_model_len=32, kv_cache_memory_gb=0.001)
    assert str(err.value).startswith("backend 'megakernel': ") and "\n" not in str(err.value)


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_next", "kimi_linear", "gemma3_text", "gpt_oss",
                                     *(pytest.param(v, marks=pytest.mark.slow) for v in ("qwen3_moe", "mistral"))])
def test_families_on_the_megakernel_in_the_engine_match_xla(tiny_family_dir, variant, monkeypatch):
    """Qwen3-MoE (a dense first layer, then sparse ones), DeepSeek-V3 (MLA, group-limited
    sigmoid routing, a shared expert), Qwen3-Next (Gated DeltaNet and gated full attention, MoE),
    Kimi Linear (KDA and NoPE MLA, MoE), Gemma 3 (sandwich norms, sliding and full layers: two page
    groups, the sliding group's pages freed as the window moves), gpt-oss (sinks, biased experts
    with the clamped SwiGLU, sliding and full layers) and Mistral (every layer sliding) on the
    megakernel in the engine (Qwen3-MoE and Mistral in the slow set): three prompts in a
    batch bucket of four (a padding row), the fused decode loop, then speculative verification
    (the verify block; the linear layers' states rolled back past rejected drafts) on drafts of
    the XLA continuation whose third draft is wrong: the XLA backend's greedy tokens, drafts
    accepted, and no page leaked."""
    directory = tiny_family_dir(variant)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:2] + ["Paris is the capital of France. Paris is the capital of"]  # 3 rows: bucket 4
    xla = [o.outputs[0].token_ids for o in _llm(directory, "xla").generate(prompts, params)]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}):
        llm = LLM(model=str(directory), dtype="float32", max_model_len=64, kv_cache_memory_gb=0.01, steps_per_call=4,
                  backend="megakernel", max_num_seqs=4, speculative_config=spec)
        ids = [llm.tokenizer.encode(p) for p in prompts]
        if spec is not None:  # the host drafts the reference for every row
            llm.engine.proposer = ReferenceProposer(ids, xla, llm.cfg.vocab_size)
            monkeypatch.setattr(llm.engine.runner, "drafter", None)
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
        assert [o.outputs[0].token_ids for o in outs] == xla
        bm = llm.engine.block_manager
        assert bm.num_free_pages == bm.num_pages
        if spec is not None:
            assert llm.engine.spec_stats()["spec_num_accepted_tokens"] >= 2 * len(prompts)  # the verify block ran


def test_dspark_on_the_megakernel_reads_its_hidden_states(tiny_llama_dir, tmp_path):
    """The kernel returns the residual streams the drafter reads (capture_layers): DSpark
    speculation on the megakernel keeps the XLA backend's greedy tokens, and drafts."""
    from weld.engine.spec import dspark

    directory, _ = tiny_llama_dir
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    plain = _llm(directory, "xla")
    xla = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], params)]
    cfg = dspark.DraftConfig.for_target(plain.cfg, block_size=3, target_layers=(0, plain.cfg.num_layers - 1),
                                        num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32, markov_rank=4)
    dspark.save(tmp_path, dspark.init_params(cfg, seed=1, target_weights=plain.model.weights), cfg)
    llm = LLM(model=str(directory), dtype="float32", max_model_len=64, kv_cache_memory_gb=0.01, steps_per_call=4,
              backend="megakernel", speculative_config={"method": "dspark", "model": str(tmp_path),
                                                        "confidence_threshold": 0.0, "adaptive": False})
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)] == xla
    assert llm.engine.spec_stats()["spec_num_draft_tokens"] > 0


def test_int4_experts_mix_on_the_megakernel(tiny_family_dir):
    """`quantization="int8_channel_int4_experts"` with `backend="megakernel"`: the expert stacks
    are int4 g128 rows quantized once at load and the kernel streams those arrays themselves
    (the rest int8 per channel); its greedy tokens are the XLA backend's on the same weights."""
    import jax

    from weld.models import megakernel
    from weld.models.common import quant

    directory = tiny_family_dir("qwen3_moe")[0]
    mix = "int8_channel_int4_experts"
    llm = _llm(directory, "megakernel", mix)
    lw = next(lw for lw in llm.model.weights["layers"] if "moe" in lw)
    assert lw["moe"]["w_down"].fmt == "int4_g128_rows" and lw["wq"].fmt == "int8_channel"
    params = megakernel.kernel_params(llm.cfg, llm.model.weights)
    sparse = llm.cfg.sparse_layers[0]
    assert params["layers"][sparse]["down"].q is lw["moe"]["w_down"].codes and megakernel.int4_experts(params)
    assert not any(quant.is_quantized(w) for w in jax.tree_util.tree_leaves(params, is_leaf=quant.is_quantized))
    params_run = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    xla = [o.outputs[0].token_ids for o in _llm(directory, "xla", mix).generate(PROMPTS[:2], params_run)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params_run)] == xla



def test_the_engine_places_row_major_pools_as_on_a_tpu(tiny_family_dir, monkeypatch):
    """With the pools row-major (`sharding.pool_layouts`: the megakernel on a TPU, forced here on
    the CPU) the runner creates the cache placed (`sharding.cache_placement`: each KV pool a
    row-major `Format` on the device, the recurrent states as XLA lays them out), every program
    gives it back so, the cache is sized by `sharding.page_bytes`, and the greedy text is the
    XLA backend's (Qwen3-Next: pools and recurrent states side by side)."""
    from jax.experimental.layout import Format

    from weld.models.common import cache as cache_lib
    from weld.models.common import sharding

    directory = tiny_family_dir("qwen3_next")[0]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    xla = [o.outputs[0].token_ids for o in _llm(directory, "xla").generate(PROMPTS[:2], params)]
    monkeypatch.setattr(sharding, "pool_layouts", lambda backend, mesh: "row_major" if backend == "megakernel" else None)
    measured = []
    page_bytes = sharding.page_bytes
    monkeypatch.setattr(sharding, "page_bytes", lambda *a, **k: measured.append(a[0]) or page_bytes(*a, **k))
    llm = _llm(directory, "megakernel")
    runner = llm.engine.runner
    assert runner.row_major_pools and measured
    placement = runner._cache_shardings
    kinds = set()
    for layer, placed in zip(runner.cache.layers, placement.layers):
        arrays = [f.name for f in dataclasses.fields(layer) if not f.metadata.get("static")]
        for x, p in ((getattr(layer, a), getattr(placed, a)) for a in arrays):
            row_major = isinstance(p, Format) and tuple(p.layout.major_to_minor) == tuple(range(x.ndim))
            assert row_major == isinstance(layer, cache_lib.KVPages), (type(layer).__name__, p)
            kinds.add(type(layer).__name__)
    assert kinds == {"KVPages", "RecurrentState"}
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)] == xla
    assert all(type(x.sharding).__name__ == "SingleDeviceSharding" for x in jax.tree.leaves(runner.cache))
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages
