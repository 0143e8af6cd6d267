"""Quantized weights through the engine users get: a GGUF's blocks kept by default, `quantization`
"none" / "int8" / "int4", every family, and the bad settings. Accuracy is judged by the
teacher-forced log probabilities of fixed text (`prompt_logprobs`), against the f32 engine."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.conftest import ENGINE_VARIANTS
from weld import LLM, SamplingParams
from weld.models.common import quant
from weld.utils.errors import InvalidInputError

TEXT = ("The lighthouse keeper wound the clock at dusk, at midnight and at four in the morning. "
        "def median(values):\n    ordered = sorted(values)\n    return ordered[len(ordered) // 2]\n"
        "Light travels about 299,792 kilometres per second.")
SMALL = dict(max_model_len=256, kv_cache_memory_gb=0.05, max_num_seqs=2)


def quantized_leaves(llm) -> list[quant.QuantWeight]:
    leaves = jax.tree_util.tree_leaves(llm.model.weights, is_leaf=quant.is_quantized)
    return [leaf for leaf in leaves if quant.is_quantized(leaf)]


def text_logprobs(llm, text: str = TEXT) -> np.ndarray:
    """log p of every token of text after the first, teacher-forced."""
    ids = llm.get_tokenizer().encode(text)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return np.array([entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])])


@pytest.fixture(scope="module")
def smollm2_f32():
    return LLM(quantization="none", **SMALL)


def test_gguf_blocks_are_kept_by_default(smollm2_f32):
    """The bundled Q4_1 GGUF: every projection and the tied embedding stay in their blocks (a
    quarter of the f32 bytes), and the text's log probabilities stay those of the dequantized
    model up to the int8 rounding of the activations."""
    kept = LLM(**SMALL)
    leaves = quantized_leaves(kept)
    cfg = kept.cfg
    assert len(leaves) == 4 * cfg.num_layers + 1  # wqkv, wo, w_gate_up, w_down per layer; embed
    assert {leaf.fmt for leaf in leaves} == {"q4_1", "q8_0"}  # the file's token_embd is Q8_0
    assert not quantized_leaves(smollm2_f32)
    f32_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(smollm2_f32.model.weights))
    kept_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(kept.model.weights))
    assert kept_bytes < 0.2 * f32_bytes
    ours, ref = text_logprobs(kept), text_logprobs(smollm2_f32)
    assert abs(ours.mean() / ref.mean() - 1) < 0.02  # measured 0.3% in perplexity (benchmarks/perplexity.py)
    assert np.abs(ours - ref).max() < 1.0
    outs = kept.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.parametrize("mode,tolerance", [("int8", 0.01), ("int4", 0.05), ("int4_g128", 0.08)])
def test_quantization_of_a_gguf(smollm2_f32, mode, tolerance):
    """int8 / int4 quantize the dequantized projections and head once at load; int4 gives the
    (tied) head 8 bits."""
    llm = LLM(quantization=mode, **SMALL)
    leaves = quantized_leaves(llm)
    assert len(leaves) == 4 * llm.cfg.num_layers + 1 and {leaf.fmt for leaf in leaves} == {mode, "int8"}
    assert llm.model.weights["embed"].fmt == "int8"
    ours, ref = text_logprobs(llm), text_logprobs(smollm2_f32)
    assert abs(ours.mean() / ref.mean() - 1) < tolerance


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
@pytest.mark.parametrize("mode", ["int8", "int4", "int4_g128", "int8_channel", "int8_channel_int4_experts"])
def test_every_family_quantizes(variant, mode, tiny_family_dir):
    """An HF checkpoint of every family with quantization int8 / int4: its projections (and
    expert stacks) are quantized and the text scores as the f32 engine's up to the rounding (tiny random models:
    the tolerances are loose, the failure they catch is a matrix read in the wrong layout)."""
    directory, _ = tiny_family_dir(variant)
    engine = dict(dtype="float32", max_model_len=96, page_size=4, kv_cache_memory_gb=0.004, max_num_seqs=2)
    f32, q = LLM(str(directory), **engine), LLM(str(directory), quantization=mode, **engine)
    assert quantized_leaves(q) and not quantized_leaves(f32)
    stacks = [x for lw in q.model.weights["layers"] for name, x in lw.get("moe", {}).items()
              if name in ("w_gate_up", "w_down")]
    assert bool(stacks) == bool(q.cfg.moe) and all(quant.is_quantized(x) and x.ndim == 3 for x in stacks)
    if mode == "int8_channel_int4_experts":  # experts int4 per 128 inputs, every other matrix int8 per channel
        assert all(x.fmt == "int4_g128_rows" for x in stacks)
        assert {x.fmt for x in quantized_leaves(q)} - {"int4_g128_rows"} == {"int8_channel"}
    text = "Once upon a time there was a small model. def add(a, b): return a + b"
    ours, ref = text_logprobs(q, text), text_logprobs(f32, text)
    # The mean deviation relative to the mean score: a matrix read in the wrong layout moves it by
    # ~100%, rounding by a few % (per channel: a coarser step than per 32; the hybrids' recurrent
    # state carries rounding from token to token: int4 ~9% on the tiny Qwen3-Next, ~3% on Qwen3-MoE).
    scale = {"int8": 0.03, "int8_channel": 0.06, "int4": 0.15, "int4_g128": 0.2, "int8_channel_int4_experts": 0.2}[mode]
    assert np.abs(ours - ref).mean() < scale * np.abs(ref).mean(), (variant, mode)
    assert np.abs(ours - ref).max() > 0  # really quantized


def test_bad_quantization_settings():
    with pytest.raises(InvalidInputError, match="quantization must be one of none, int8, int4, int4_g128, int8_channel"):
        LLM(quantization="fp8")
    with pytest.raises(InvalidInputError, match="int8 per output channel .quantization 'int8_channel'. or with int4 "
                                                "experts .'int8_channel_int4_experts'., not 'int8'"):
        LLM(quantization="int8", backend="megakernel")
