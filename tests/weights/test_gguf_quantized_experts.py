"""A GGUF whose expert stacks are quantized (as real MoE GGUFs' are) keeps them in their blocks,
one QuantWeight stack per `*_exps` tensor, instead of dequantizing them to f32 (8x the bytes of
Q4). The fixtures are the llama.cpp-converted tiny MoE models of tests/data/gguf/, re-written
with their matrices quantized by gguf-py."""

from __future__ import annotations

import pathlib

import gguf
import jax
import numpy as np
import pytest

from tests.data.make_gguf_fixtures import OUT_DIR
from weld import LLM, SamplingParams
from weld.models.common import quant
from weld.weights import ModelSource, load_model

Q = gguf.GGMLQuantizationType


def requantized(src, dst, qtype_of) -> str:
    """src re-written to dst with every tensor qtype_of(name, shape) names (None: as it is)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        qtype = qtype_of(t.name, data.shape) if t.tensor_type == Q.F32 else None
        if qtype is None:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(dst)


def experts_quantized(name: str, shape: tuple) -> Q | None:
    if "_exps.weight" not in name or shape[-1] % 32:
        return None
    return Q.Q4_1 if "down" in name else Q.Q8_0


def experts_mxfp4(name: str, shape: tuple) -> Q | None:
    """As llama.cpp ships gpt-oss: every expert matrix in MXFP4."""
    return Q.MXFP4 if "_exps.weight" in name and shape[-1] % 32 == 0 else None


FORMATS = {"qwen3_moe": (experts_quantized, {"w_down": "q4_1"}, "q8_0"),
           "mixtral": (experts_quantized, {"w_down": "q4_1"}, "q8_0"),
           "gpt_oss": (experts_mxfp4, {}, "mxfp4")}


@pytest.mark.parametrize("variant", list(FORMATS))
def test_quantized_expert_stacks_stay_in_their_blocks(variant, tmp_path):
    qtype_of, special, usual = FORMATS[variant]
    path = requantized(OUT_DIR / f"{variant}.gguf", tmp_path / f"{variant}-q.gguf", qtype_of)
    source = ModelSource("gguf", pathlib.Path(path), variant)
    plain, kept = load_model(source, dtype="float32", quantization="none"), load_model(source, dtype="float32")
    checked = 0
    for lw_plain, lw_kept in zip(plain.weights["layers"], kept.weights["layers"]):
        for name in ("w_gate", "w_up", "w_down"):
            if name not in lw_kept.get("moe", {}):
                continue
            stack = lw_kept["moe"][name]
            assert quant.is_quantized(stack) and stack.shape == lw_plain["moe"][name].shape
            assert stack.fmt == special.get(name, usual)
            np.testing.assert_array_equal(np.asarray(stack.unpacked()), np.asarray(lw_plain["moe"][name]))
            checked += 1
    assert checked >= 3

    # Through the engine: gate and up fused as blocks, the same text as the dequantized model up to
    # the int8 rounding of the activations.
    engine = dict(dtype="float32", max_model_len=64, page_size=4, kv_cache_memory_gb=0.002, max_num_seqs=2)
    llm, f32 = LLM(path, **engine), LLM(path, quantization="none", **engine)
    fused = [lw["moe"]["w_gate_up"] for lw in llm.model.weights["layers"] if "moe" in lw]
    assert fused and all(quant.is_quantized(w) and w.ndim == 3 and w.fmt == usual for w in fused)
    ids = [{"prompt_token_ids": [3, 17, 9, 28, 5, 11, 40, 2, 7]}]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def logprobs(engine_):
        out = engine_.generate(ids, params, use_tqdm=False)[0]
        toks = ids[0]["prompt_token_ids"]
        return np.array([out.prompt_logprobs[i][toks[i]].logprob for i in range(1, len(toks))])

    ours, ref = logprobs(llm), logprobs(f32)
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    leaves = jax.tree_util.tree_leaves(f32.model.weights, is_leaf=quant.is_quantized)
    assert not any(quant.is_quantized(x) for x in leaves)  # "none" dequantized everything
