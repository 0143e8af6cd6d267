"""GGUF loading: metadata, llama.cpp's Q/K permutation, tied heads, rope_freqs, bad files."""

from __future__ import annotations

import functools
import shutil

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from tests.weights.tiny_gguf import llama_kv, write_gguf
from weld.models.common import layers, quant
from weld.models.common.spec import iter_specs
from weld.utils.errors import ModelNotFoundError, UnsupportedModelError, WeldError
from weld.weights import ModelSource, load_model
from weld.weights.gguf import GGUFFile, _Reader, read_metadata
from weld.weights.tree import CheckpointError

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, VOCAB, LAYERS = 4, 2, 16, 64, 128, 96, 2


def converter_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim but for numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def hf_layout_tensors(rng, bias: bool = False, qk_norm: bool = False, tied: bool = True) -> dict:
    """Random weights in HF layout, named as in GGUF."""
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    t = {"token_embd.weight": r(VOCAB, HIDDEN), "output_norm.weight": r(HIDDEN)}
    if not tied:
        t["output.weight"] = r(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": r(HIDDEN), p + "attn_q.weight": r(HEADS * HEAD_DIM, HIDDEN),
              p + "attn_k.weight": r(KV_HEADS * HEAD_DIM, HIDDEN), p + "attn_v.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "attn_output.weight": r(HIDDEN, HEADS * HEAD_DIM), p + "ffn_norm.weight": r(HIDDEN),
              p + "ffn_gate.weight": r(FFN, HIDDEN), p + "ffn_up.weight": r(FFN, HIDDEN),
              p + "ffn_down.weight": r(HIDDEN, FFN)}
        if bias:
            t |= {p + "attn_q.bias": r(HEADS * HEAD_DIM), p + "attn_k.bias": r(KV_HEADS * HEAD_DIM),
                  p + "attn_v.bias": r(KV_HEADS * HEAD_DIM)}
        if qk_norm:
            t |= {p + "attn_q_norm.weight": r(HEAD_DIM), p + "attn_k_norm.weight": r(HEAD_DIM)}
    return t


def as_llama_cpp_writes_it(tensors: dict) -> dict:
    out = {}
    for name, w in tensors.items():
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            w = converter_permute(w, HEADS, HEADS)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            w = converter_permute(w, HEADS, KV_HEADS)
        out[name] = w
    return out


GGUF_TO_TREE = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
                "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
                "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}


def leaf(weights: dict, gguf_name: str):
    """Independent of weld's key map: the tree leaf a GGUF name should land in."""
    top = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
    if gguf_name in top:
        return weights[top[gguf_name]]
    _, i, part, kind = gguf_name.split(".")
    key = {"attn_q": "bq", "attn_k": "bk", "attn_v": "bv"}[part] if kind == "bias" else GGUF_TO_TREE[part]
    return weights["layers"][int(i)][key]


def load(path, quantization="none", **kw):
    """Dequantized unless quantization=None (a GGUF's blocks kept)."""
    return load_model(ModelSource("gguf", path, path.stem), quantization=quantization, **kw)


def test_llama_q_k_unpermuted_and_rope_freqs(tmp_path):
    rng = np.random.default_rng(0)
    hf = hf_layout_tensors(rng, tied=False)
    rope_freqs = rng.uniform(1, 8, HEAD_DIM // 2).astype(np.float32)
    path = write_gguf(tmp_path / "llama.gguf", "llama", llama_kv(LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB),
                      as_llama_cpp_writes_it(hf) | {"rope_freqs.weight": rope_freqs})
    m = load(path)
    assert m.cfg.architecture == "llama" and not m.cfg.tie_word_embeddings
    np.testing.assert_allclose(m.cfg.rope_freq_factors, rope_freqs)
    for name, w in hf.items():
        np.testing.assert_array_equal(np.asarray(leaf(m.weights, name)), w, err_msg=name)
    # the file really is permuted, so the test above could fail
    assert not np.array_equal(GGUFFile(path).dequantize("blk.0.attn_k.weight"), hf["blk.0.attn_k.weight"])


def test_qwen2_not_permuted_biases_and_tied(tmp_path):
    rng = np.random.default_rng(1)
    hf = hf_layout_tensors(rng, bias=True, tied=True)
    path = write_gguf(tmp_path / "qwen2.gguf", "qwen2", llama_kv(LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB), hf)
    m = load(path, dtype="bfloat16")
    assert m.cfg.architecture == "qwen2" and m.cfg.tie_word_embeddings and "lm_head" not in m.weights
    for name, w in hf.items():
        got = leaf(m.weights, name)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), w.astype(jnp.bfloat16), err_msg=name)


def test_qwen3_q_k_norms(tmp_path):
    hf = hf_layout_tensors(np.random.default_rng(2), qk_norm=True)
    kv = llama_kv(LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB) | {"attention.key_length": HEAD_DIM}
    m = load(write_gguf(tmp_path / "qwen3.gguf", "qwen3", kv, hf), dtype=jnp.float16)
    assert m.cfg.qk_norm
    for name, w in hf.items():
        np.testing.assert_array_equal(np.asarray(leaf(m.weights, name)), w.astype(np.float16), err_msg=name)


def test_metadata_is_plain_python(tmp_path):
    kv = llama_kv() | {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "é<", ""],
                       "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 3, 1, 6],
                       "tokenizer.ggml.scores": [0.0, -1.5, -2.25, 0.5], "tokenizer.ggml.add_bos_token": True}
    meta = read_metadata(write_gguf(tmp_path / "m.gguf", "llama", kv, {}))
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2 and isinstance(meta["llama.block_count"], int)
    assert meta["tokenizer.ggml.tokens"] == ["a", "b", "é<", ""]
    assert meta["tokenizer.ggml.merges"] == ["a b"]
    assert meta["tokenizer.ggml.token_type"] == [1, 3, 1, 6] and type(meta["tokenizer.ggml.token_type"][0]) is int
    assert meta["tokenizer.ggml.scores"] == [0.0, -1.5, -2.25, 0.5]
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert not any(k.startswith("GGUF.") for k in meta)


def test_fast_reader_matches_gguf_reader(default_gguf, tmp_path):
    """weld's reader subclass (a speed fix) must read exactly what gguf's own reader does."""
    path = write_gguf(tmp_path / "x.gguf", "llama", llama_kv() | {"tokenizer.ggml.tokens": ["x", "y"]},
                      {"a": np.arange(96, dtype=np.float32).reshape(3, 32),
                       "b": (gguf.quants.quantize(np.ones((2, 64), np.float32), Q.Q8_0), Q.Q8_0)})
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    for t in theirs.tensors:
        np.testing.assert_array_equal(ours.tensors[t.name].data, t.data)
        assert ours.tensors[t.name].data_offset == t.data_offset


# ----- bad input: each a WeldError with a one-line message naming the file -----

def check_error(exc_info, *words):
    message = str(exc_info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        load(tmp_path / "absent.gguf")
    check_error(e, "absent.gguf", "no such")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError) as e:
        load(path)
    check_error(e, "noise.gguf", "not a GGUF")
    path.write_bytes(b"")
    with pytest.raises(WeldError) as e:
        load(path)
    check_error(e, "noise.gguf", "not a GGUF")


def test_gguf_magic_then_garbage(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError) as e:
        load(path)
    check_error(e, "garbage.gguf")


@pytest.mark.parametrize("quantization", ["none", None], ids=["dequantized", "blocks-kept"])
@pytest.mark.parametrize("keep", [0.5, 0.0003], ids=["in-tensor-data", "in-header"])
def test_truncated_real_file(default_gguf, tmp_path, keep, quantization):
    path = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    with open(path, "r+b") as f:
        f.truncate(int(default_gguf.stat().st_size * keep))
    with pytest.raises(CheckpointError) as e:
        load(path, quantization=quantization)
    check_error(e, "cut.gguf", "truncated")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"block_count": 1}, {"token_embd.weight": np.zeros((4, 8))})
    with pytest.raises(UnsupportedModelError) as e:
        load(path)
    check_error(e, "gpt2.gguf", "'gpt2'")


def test_unsupported_tensor_type(tmp_path):
    hf = hf_layout_tensors(np.random.default_rng(3))
    raw = np.zeros((HEADS * HEAD_DIM, HIDDEN // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)
    hf["blk.1.attn_q.weight"] = (raw, Q.Q8_1)
    path = write_gguf(tmp_path / "iq.gguf", "llama", llama_kv(LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB), hf)
    with pytest.raises(UnsupportedModelError) as e:
        load(path)
    check_error(e, "iq.gguf", "blk.1.attn_q.weight", "Q8_1")


def test_unmapped_and_missing_tensors(tmp_path):
    hf = hf_layout_tensors(np.random.default_rng(4))
    del hf["blk.1.ffn_up.weight"]
    hf["blk.0.ffn_extra.weight"] = np.zeros((4, 4), np.float32)
    path = write_gguf(tmp_path / "odd.gguf", "llama", llama_kv(LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB), hf)
    with pytest.raises(CheckpointError) as e:
        load(path)
    check_error(e, "odd.gguf", "blk.0.ffn_extra.weight", "blk.1.ffn_up.weight")


def test_kept_blocks_are_the_dequantized_matrices(tmp_path):
    """Blocks kept (quantization None): Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 matrices load as QuantWeights that state
    exactly the matrices the dequantizing load gives (llama.cpp's Q/K permutation undone on the
    blocks' rows); other types (F16 here) and 1-D tensors are dequantized as before."""
    rng = np.random.default_rng(9)
    hf = as_llama_cpp_writes_it(hf_layout_tensors(rng, tied=False))
    types = {"blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q4_0, "blk.1.attn_q.weight": Q.Q8_0,
             "blk.0.ffn_down.weight": Q.Q8_0, "token_embd.weight": Q.Q4_1, "blk.1.ffn_up.weight": Q.Q5_0,
             "blk.1.ffn_gate.weight": Q.Q5_1, "blk.0.ffn_up.weight": Q.F16}
    tensors = {name: (gguf.quants.quantize(w, types[name]), types[name]) if name in types else w
               for name, w in hf.items()}
    path = write_gguf(tmp_path / "mixed.gguf", "llama", llama_kv(LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB), tensors)
    plain, kept = load(path), load(path, quantization=None)
    for name in hf:
        a, b = leaf(plain.weights, name), leaf(kept.weights, name)
        assert isinstance(b, quant.QuantWeight) == (name in types and types[name] != Q.F16), name
        np.testing.assert_array_equal(np.asarray(layers.unpacked(b)), np.asarray(a), err_msg=name)
    assert leaf(kept.weights, "token_embd.weight").fmt == "q4_1"
    # the Q rows really were permuted in the file: the kept blocks were reordered, not read as stored
    stored = quant.gguf_blocks(GGUFFile(path).tensors["blk.0.attn_q.weight"].data, "Q4_1",
                               (HEADS * HEAD_DIM, HIDDEN)).packed().unpacked()
    assert not np.array_equal(np.asarray(stored), np.asarray(leaf(plain.weights, "blk.0.attn_q.weight")))


# ----- the real default model -----

@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, quantization="none")


def test_default_model_every_leaf_has_its_declared_shape(smollm2):
    m = smollm2
    assert m.source.kind == "gguf" and m.source.name == "SmolLM2-135M-Instruct"
    assert (m.cfg.num_layers, m.cfg.hidden_size, m.cfg.num_heads, m.cfg.num_kv_heads) == (30, 576, 9, 3)
    assert m.cfg.tie_word_embeddings and "lm_head" not in m.weights
    leaves = list(iter_specs(m.family.weight_specs(m.cfg)))
    assert len(leaves) == 2 + 9 * 30
    for path, spec in leaves:
        node = m.weights
        for key in path:
            node = node[key]
        assert node.shape == spec.shape and node.dtype == jnp.float32, path
    assert len(m.gguf_metadata["tokenizer.ggml.tokens"]) == 49152
    assert m.gguf_metadata["tokenizer.chat_template"].startswith("{% for message in messages %}")


def test_default_model_matches_transformers(smollm2, default_gguf, monkeypatch):
    """transformers dequantizes the GGUF and undoes llama.cpp's Q/K permutation its own way."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    transformers = pytest.importorskip("transformers")
    # Speed only (40 s -> ~15 s): transformers parses the file twice (config, then tensors) and
    # rebuilds gguf's tensor-name table for each of ~400 submodules. Hand it one parse, by weld's
    # reader (same bytes as gguf's, see test_fast_reader_matches_gguf_reader), and a cached table.
    reader = _Reader(default_gguf, "r")
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    ref = transformers.AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    sd = ref.state_dict()
    pairs = {"model.embed_tokens.weight": smollm2.weights["embed"],
             "model.layers.0.self_attn.q_proj.weight": smollm2.weights["layers"][0]["wq"],
             "model.layers.0.self_attn.k_proj.weight": smollm2.weights["layers"][0]["wk"],
             "model.layers.29.self_attn.k_proj.weight": smollm2.weights["layers"][29]["wk"],
             "model.layers.29.mlp.down_proj.weight": smollm2.weights["layers"][29]["w_down"],
             "model.layers.7.post_attention_layernorm.weight": smollm2.weights["layers"][7]["mlp_norm"],
             "model.norm.weight": smollm2.weights["final_norm"]}
    for name, ours in pairs.items():
        np.testing.assert_allclose(np.asarray(ours), sd[name].float().numpy(), atol=1e-6, rtol=0, err_msg=name)
