"""Config parsing: HF config.json in both rope spellings, GGUF metadata, and clear errors."""

import numpy as np
import pytest

from weld.models.common.rope import rope_inv_freq
from weld.models.llama import Config

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_both_rope_spellings_agree():
    old = Config.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    new = Config.from_hf({**BASE, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}})
    assert old == new
    assert old.rope_theta == 500000.0 and old.rope_scaling.kind == "llama3" and old.rope_scaling.factor == 8.0
    assert hash(old) == hash(new)  # usable as a static jit argument


def test_llama3_scaling_changes_only_low_frequencies():
    cfg = Config.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    plain, _ = rope_inv_freq(16, 500000.0, Config.from_hf(BASE).rope_scaling, 4096)
    scaled, _ = rope_inv_freq(16, 500000.0, cfg.rope_scaling, 4096)
    assert scaled[0] == plain[0]  # the highest frequency is untouched
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0)  # the lowest is divided by the factor


def test_family_switches():
    qwen2 = Config.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True})
    qwen3 = Config.from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.tie_word_embeddings
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    assert Config.from_hf(BASE).head_dim == 16


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads (3)"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
])
def test_bad_configs_name_the_value(change, needle):
    with pytest.raises(ValueError, match=None) as err:
        Config.from_hf({**BASE, **change})
    assert needle in str(err.value)


def test_from_gguf_metadata():
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
            "llama.rope.freq_base": 100000.0, "llama.context_length": 2048,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "tokenizer.ggml.tokens": ["a"] * 300,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1}
    cfg = Config.from_gguf(meta, {"token_embd.weight": (300, 64)})
    assert (cfg.vocab_size, cfg.num_layers, cfg.head_dim, cfg.rope_theta) == (300, 2, 16, 100000.0)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    untied = Config.from_gguf(meta, {"output.weight": (300, 64), "blk.0.attn_q.bias": (64,)})
    assert not untied.tie_word_embeddings and untied.qkv_bias
    with pytest.raises(ValueError, match="feed_forward_length"):
        Config.from_gguf({k: v for k, v in meta.items() if k != "llama.feed_forward_length"}, {})
