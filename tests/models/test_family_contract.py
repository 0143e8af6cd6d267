"""The model contract: every registered family implements it, the registry is one table, caches
are sized from cache specs only, and a variant weld does not implement is refused at load."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld import models
from weld.models import deepseek, family, gemma3
from weld.models.common.cache import CacheSpec, KVPages, LatentPages, PagedKV, PagedLatent, Recurrent
from weld.models.common.spec import random_weights
from weld.utils.errors import UnsupportedModelError
from weld.weights import ModelSource, load_model


@pytest.mark.parametrize("module", models.FAMILIES, ids=lambda m: m.NAME)
def test_every_family_implements_the_protocol(module):
    assert isinstance(module, family.ModelFamily)
    fields = {f.name for f in dataclasses.fields(module.Config)}
    assert set(family.ENGINE_CONFIG_FIELDS) <= fields | {n for n in dir(module.Config)}
    for name in module.HF_ARCHITECTURES:
        assert models.HF_TABLE[name] is module
    for name in module.GGUF_ARCHITECTURES:
        assert models.GGUF_TABLE[name] is module


def test_a_config_without_an_engine_field_is_caught():
    @dataclasses.dataclass(frozen=True)
    class Partial:
        vocab_size: int = 1

    with pytest.raises(TypeError, match="hidden_size"):
        family.check_config(Partial())


def test_the_registry_names_what_it_supports():
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM") as err:
        models.family_for_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert "GPT2LMHeadModel" in str(err.value)
    assert models.family_for_hf({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}) is deepseek
    assert models.family_for_gguf("gemma3") is gemma3
    with pytest.raises(ValueError, match="'falcon'"):
        models.family_for_gguf("falcon")


def test_cache_specs_size_every_kind():
    spec = CacheSpec((PagedKV(2, 8), PagedKV(2, 8, window=4), PagedLatent(16, 4)))
    assert spec.bytes_per_token(jnp.float32) == 2 * (2 * 2 * 8 * 4) + (16 + 4) * 4
    cache = spec.create(num_pages=5, page_size=4, dtype=jnp.bfloat16)
    assert isinstance(cache.layers[0], KVPages) and isinstance(cache.layers[2], LatentPages)
    assert cache.layers[0].k.shape == (5, 4, 16) and cache.layers[0].kv_heads == 2  # a token's 2 heads of 8 in a row
    assert cache.layers[2].pool.shape == (5, 4, 20) and cache.num_pages == 5 and cache.page_size == 4
    recurrent = CacheSpec((PagedKV(2, 8), Recurrent(conv_channels=12, conv_width=4, state_shape=(2, 8, 8))))
    assert recurrent.bytes_per_sequence() == 4 * (12 * 3 + 128) and recurrent.bytes_per_token(jnp.float32) == 128
    with pytest.raises(ValueError, match="linear-attention"):
        recurrent.create(4, 4, jnp.float32)


def test_deepseek_v3_latent_cache_is_a_fraction_of_expanded_kv():
    """DeepSeek-V3's shapes: 576 values per token per layer instead of per-head K and V."""
    cfg = deepseek.Config.from_hf({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "max_position_embeddings": 163840})
    latent = deepseek.cache_spec(cfg).bytes_per_token(jnp.bfloat16)
    expanded = 61 * 128 * (128 + 64 + 128) * 2  # K (nope + rope) and V per head
    assert latent == 61 * 576 * 2
    assert 50 < expanded / latent < 80  # ~71x
    np.testing.assert_allclose(cfg.mla.scale, 192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    assert cfg.sparse_layers == tuple(range(3, 61)) and cfg.moe.router == "sigmoid_group"


def test_gemma3_sliding_layers_declare_their_window():
    cfg = gemma3.Config.from_hf({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 7, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8,
                                 "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    windows = [layer.window for layer in gemma3.cache_spec(cfg).layers]
    assert windows == [8, 8, 8, 8, 8, None, 8]
    assert (cfg.rope_local.theta, cfg.rope_global.theta, cfg.rope_global.scaling.factor) == (1e4, 1e6, 8.0)


def write_config(directory, config: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")  # never read: the config is refused first


V32 = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 64, "hidden_size": 32,
       "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
       "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "index_topk": 64, "index_n_heads": 4}


@pytest.mark.parametrize("config,needle", [
    ({**V32, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "'index_topk'"),
    (V32, "DeepseekV32ForCausalLM"),
    ({**V32, "architectures": ["DeepseekV3ForCausalLM"], "index_topk": None, "index_n_heads": None,
      "attention_bias": True}, "'attention_bias'"),
    ({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 1, "use_bidirectional_attention": True},
     "'use_bidirectional_attention'"),
    ({**V32, "architectures": ["DeepseekV3ForCausalLM"], "index_topk": None, "index_n_heads": None,
      "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config.quant_method = 'fp8'"),
])
def test_unsupported_variants_are_refused_at_load_naming_the_field(tmp_path, config, needle):
    write_config(tmp_path / "m", config)
    with pytest.raises(UnsupportedModelError) as err:
        load_model(ModelSource("hf", tmp_path / "m", "m"))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("module", [m for m in models.FAMILIES], ids=lambda m: m.NAME)
def test_mixed_row_groups_equal_separate_calls(module, tiny_model_dir):
    """A prefill chunk and decode rows in one call (every matmul over both groups) give what two
    calls give: the engine's mixed steps rely on it."""
    variant = {"llama": "qwen3", "deepseek": "deepseek_v3", "gemma3": "gemma3_text", "gpt_oss": "gpt_oss",
               "qwen3_next": "qwen3_next", "kimi_linear": "kimi_linear"}[module.NAME]
    directory, _ = tiny_model_dir(variant)
    loaded = load_model(ModelSource("hf", directory, variant))
    from weld.models.common.cache import AttentionBatch

    cfg, spec = loaded.cfg, module.cache_spec(loaded.cfg)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 9)), jnp.int32)
    decode_prefix = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    tables = spec.tables(jnp.asarray([[0, 1, 2], [3, 4, 5], [6, 7, 8]], jnp.int32))
    fwd = jax.jit(module.forward, static_argnames=("cfg",))
    cache = spec.create(9, 4, jnp.float32, num_slots=3)
    slots = jnp.asarray([0, 1, 2], jnp.int32)  # each row's recurrent state (hybrid models)
    _, _, cache = fwd(loaded.weights, cfg, decode_prefix, jnp.broadcast_to(jnp.arange(5), (2, 5)), cache,
                      AttentionBatch(tables[1:], slots[1:]))  # the decode rows' history
    nxt = jnp.asarray([[3], [7]], jnp.int32)
    pos = jnp.asarray([[5], [5]], jnp.int32)
    mixed, _, _ = fwd(loaded.weights, cfg, (prompt, nxt), (jnp.arange(9)[None], pos), cache,
                      AttentionBatch((tables[:1], tables[1:]), (slots[:1], slots[1:])),
                      (jnp.asarray([[8]]), jnp.zeros((2, 1), jnp.int32)))
    alone_p, _, cache2 = fwd(loaded.weights, cfg, prompt, jnp.arange(9)[None], cache,
                             AttentionBatch(tables[:1], slots[:1]), jnp.asarray([[8]]))
    alone_d, _, _ = fwd(loaded.weights, cfg, nxt, pos, cache2, AttentionBatch(tables[1:], slots[1:]),
                        jnp.zeros((2, 1), jnp.int32))
    np.testing.assert_allclose(np.asarray(mixed[0]), np.asarray(alone_p), atol=2e-5)
    np.testing.assert_allclose(np.asarray(mixed[1]), np.asarray(alone_d), atol=2e-5)


def test_random_weights_of_every_family_run_with_captured_layers():
    """capture_layers returns the residual streams (index num_layers: the final hidden states)."""
    from weld.models.common.cache import AttentionBatch

    cfg = dataclasses.replace(gemma3.Config.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 40, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "sliding_window": 4}))
    weights = random_weights(gemma3.weight_specs(cfg), seed=0)
    tokens = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    args = (weights, cfg, tokens, jnp.arange(5)[None])
    table = AttentionBatch(gemma3.cache_spec(cfg).tables(jnp.asarray([[0, 1]], jnp.int32)))
    _, hidden, _ = gemma3.forward(*args, gemma3.cache_spec(cfg).create(2, 4, jnp.float32), table)
    _, states, _ = gemma3.forward(*args, gemma3.cache_spec(cfg).create(2, 4, jnp.float32), table,
                                  capture_layers=(2, 0, 3))
    assert states.shape == (1, 5, 3 * 16)
    np.testing.assert_allclose(np.asarray(states[..., 32:]), np.asarray(hidden), atol=1e-6)
    assert not np.allclose(np.asarray(states[..., :16]), np.asarray(states[..., 16:32]))
    with pytest.raises(ValueError, match="capture_layers"):
        gemma3.forward(*args, gemma3.cache_spec(cfg).create(2, 4, jnp.float32), table, capture_layers=(4,))
