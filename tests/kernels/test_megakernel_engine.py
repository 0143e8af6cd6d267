"""`backend="megakernel"` in the engine: the fused decode loop runs the megakernel (Pallas TPU
interpret mode on CPU) and must produce the XLA backend's greedy text."""

from __future__ import annotations

import pytest

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
    from weld.models import llama_megakernel as megakernel

    # the decode program really is the megakernel's (equal text alone would not prove it ran)
    assert mega_llm.engine.runner._decode.__wrapped__.args[0] is megakernel.forward
    bm = mega_llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_megakernel_takes_weights_quantized_at_load(tiny_llama_dir):
    """quantization "int8_channel": the matrices and the LM head are quantized once, at load, and
    the kernel's operands are those arrays themselves (nothing is quantized inside a call)."""
    from weld.models import llama_megakernel as megakernel
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
    from weld.models import llama_megakernel as megakernel

    cfg = llama.Config(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8)
    assert decode_forward(llama, cfg, "xla") is llama.forward
    assert decode_forward(llama, cfg, "megakernel") is megakernel.forward
    with pytest.raises(ValueError, match=r"backend must be one of \('xla', 'megakernel'\), got 'cuda'"):
        decode_forward(llama, cfg, "cuda")
    with pytest.raises(ValueError, match="no sliding-window attention"):
        decode_forward(llama, dataclasses.replace(cfg, sliding_window=8), "megakernel")


def test_cli_backend_flag():
    from weld.cli import build_parser

    parser = build_parser()
    for command in (["serve"], ["generate", "hi"], ["chat"]):
        assert parser.parse_args(command).backend == "xla"
        assert parser.parse_args(command + ["--backend", "megakernel"]).backend == "megakernel"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--backend", "cuda"])


@pytest.mark.parametrize("variant,needle", [("deepseek_v3", "does not cover the deepseek family"),
                                            ("mistral", "no sliding-window attention")])
def test_what_the_megakernel_does_not_cover_is_a_one_line_input_error(tiny_family_dir, variant, needle):
    from weld.utils.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=needle) as err:
        LLM(str(tiny_family_dir(variant)[0]), backend="megakernel", max_model_len=32, kv_cache_memory_gb=0.001)
    assert str(err.value).startswith("backend 'megakernel': ") and "\n" not in str(err.value)


def test_moe_megakernel_in_the_engine_matches_xla(tiny_family_dir):
    """Qwen3-MoE (a dense first layer, then sparse ones) on the megakernel in the engine: three
    prompts in a batch bucket of four (a padding row), the fused decode loop and, with n-gram
    speculation, the verify block: the XLA backend's greedy tokens, and no page leaked."""
    directory = tiny_family_dir("qwen3_moe")[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:2] + ["Paris is the capital of France. Paris is the capital of"]  # 3 rows: bucket 4
    xla = [o.outputs[0].token_ids for o in _llm(directory, "xla").generate(prompts, params)]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}):
        llm = LLM(model=str(directory), dtype="float32", max_model_len=64, kv_cache_memory_gb=0.01, steps_per_call=4,
                  backend="megakernel", max_num_seqs=4, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == xla
        bm = llm.engine.block_manager
        assert bm.num_free_pages == bm.num_pages
        if spec is not None:
            assert llm.engine.spec_stats()["spec_num_draft_tokens"] > 0  # the verify block ran
