"""The sharding rules on abstract meshes (no devices needed): which logical axis goes over which
mesh axes in each layout, what stays whole, the layout checks against a model's heads and
experts, the settings and flags that choose a layout, and their one-line errors."""

from __future__ import annotations

import argparse
import os
import re

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from tests.cli.test_cli import assert_clean_error, weld
from weld.config import EngineConfig, ParallelConfig, add_engine_arguments
from weld.models import deepseek, llama, qwen3_next
from weld.models.common import sharding
from weld.models.common.spec import iter_specs
from weld.utils.errors import InvalidInputError

TP4 = AbstractMesh((1, 4), ("dp", "tp"))
TP2_DP2 = AbstractMesh((2, 2), ("dp", "tp"))
EP = AbstractMesh((2, 4, 1), ("dp", "ep", "tp"))  # experts over dp x ep = 8, whole experts
SEEDS = AbstractMesh((1, 8, 4), ("dp", "ep", "tp"))  # Kimi's TP4 x EP8 on 32 cores


def test_tensor_parallel_splits_heads_mlp_and_vocab_and_keeps_the_residual_whole():
    assert sharding.partition(TP4, ("q_heads", "embed"), (64, 32)) == P("tp", None)
    assert sharding.partition(TP4, ("embed", "mlp"), (32, 96)) == P(None, "tp")
    assert sharding.partition(TP4, ("vocab", "embed"), (128, 32)) == P("tp", None)
    assert sharding.partition(TP4, ("embed",), (32,)) == P(None)
    assert sharding.partition(TP4, ("latent", "embed"), (16, 32)) == P(None, None)  # MLA's latent: shared
    # without expert parallelism the experts stay whole on every device, each expert's FFN is split
    assert sharding.partition(TP4, ("experts", "expert_mlp", "embed"), (8, 32, 16)) == P(None, "tp", None)


def test_a_dimension_the_devices_do_not_divide_stays_whole():
    assert sharding.partition(TP4, ("kv_heads", "embed"), (2 * 16, 32)) == P("tp", None)  # 32 rows: divides
    assert sharding.partition(TP4, ("vocab", "embed"), (130, 32)) == P(None, None)
    assert sharding.partition(TP4, (None, None, "kv_heads", None), (10, 4, 2, 16)) == P(None, None, None, None)


def test_expert_parallel_puts_whole_experts_over_dp_and_ep():
    assert sharding.partition(EP, ("experts", "expert_mlp", "embed"), (16, 32, 64)) == P(("dp", "ep"), None, None)
    assert sharding.partition(EP, ("q_heads", "embed"), (64, 32)) == P("ep", None)  # attention over ep x tp
    assert sharding.partition(EP, ("batch",), (4,)) == P("dp")
    # 4 experts over 8 devices do not divide: dropping axes from the front keeps ep
    assert sharding.partition(EP, ("experts", "embed"), (4, 8)) == P("ep", None)


def test_the_seeds_layout_attention_over_all_32_and_experts_tp4_x_ep8():
    assert sharding.partition(SEEDS, ("q_heads", "embed"), (64 * 192, 7168)) == P(("ep", "tp"), None)
    assert sharding.partition(SEEDS, ("experts", "expert_mlp", "embed"), (384, 2048, 7168)) == P("ep", "tp", None)
    assert sharding.partition(SEEDS, ("experts", "embed", "expert_mlp"), (384, 7168, 2048)) == P("ep", None, "tp")


def _cfg(**overrides):
    fields = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
              "head_dim": 8, "vocab_size": 256, **overrides}
    return llama.Config.from_hf(fields)


def _moe_cfg(**overrides):
    return _cfg(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_attention_heads=8,
                num_experts_per_tok=2, moe_intermediate_size=32, **overrides)


def test_every_declared_weight_gets_a_split_the_devices_divide():
    cfg = _moe_cfg(num_key_value_heads=2, num_experts=8)
    for mesh in (TP4, TP2_DP2, EP, SEEDS):
        split = 0
        for path, spec in iter_specs(llama.weight_specs(cfg)):
            part = sharding.partition(mesh, spec.axes, spec.shape)
            for size, entry in zip(spec.shape, part):
                axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
                assert size % sharding.axis_size(mesh, axes) == 0, (path, part)
            split += any(e is not None for e in part)
        assert split > 0


def test_layout_checks_name_the_numbers():
    cfg = _cfg()
    spec = llama.cache_spec(cfg)
    sharding.check_layout(cfg, spec, AbstractMesh((1, 2), ("dp", "tp")))  # 6 heads, 2 KV heads: fine
    sharding.check_layout(cfg, spec, AbstractMesh((1, 6), ("dp", "tp")))  # 2 KV heads replicated 3 times
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 attention heads"):
        sharding.check_layout(cfg, spec, TP4)
    cfg = _cfg(num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(ValueError, match="3 KV heads do not divide tensor_parallel_size 4"):
        sharding.check_layout(cfg, llama.cache_spec(cfg), TP4)
    moe = _moe_cfg(num_key_value_heads=8, num_experts=6)
    sharding.check_layout(moe, llama.cache_spec(moe), TP4)  # experts whole: 6 is fine
    with pytest.raises(ValueError, match="6 routed experts do not divide over 8 expert-parallel devices"):
        sharding.check_layout(moe, llama.cache_spec(moe), EP)


def test_mla_and_linear_attention_heads_are_checked():
    mla = deepseek.Config.from_hf({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                   "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                                   "num_attention_heads": 6, "num_key_value_heads": 6, "q_lora_rank": 16,
                                   "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                   "v_head_dim": 8, "vocab_size": 256, "first_k_dense_replace": 1})
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        sharding.check_layout(mla, deepseek.cache_spec(mla), TP4)
    hybrid = qwen3_next.Config.from_hf({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                                        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                        "vocab_size": 256, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
                                        "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                        "layer_types": ["linear_attention", "full_attention"],
                                        "num_experts": 0, "decoder_sparse_step": 1, "mlp_only_layers": [0, 1]})
    with pytest.raises(ValueError, match="does not divide the model's 6 linear-attention value heads"):
        sharding.check_layout(hybrid, qwen3_next.cache_spec(hybrid), TP4)


def _pool_specs(family, cfg, mesh, num_pages: int = 8) -> list:
    import jax
    import jax.numpy as jnp

    cache = jax.eval_shape(lambda: family.cache_spec(cfg).create(num_pages, 4, jnp.float32))
    return [next(iter(vars(layer).values())).spec for layer in sharding.cache_shardings(cache, mesh).layers]


def test_data_parallel_splits_every_pool_along_its_pages():
    """Each dp rank its own pages (K/V and MLA's latent pool alike); KV heads split over all the
    tensor devices of a group or none."""
    dense = _cfg(num_key_value_heads=2)
    assert set(_pool_specs(llama, dense, TP2_DP2)) == {P("dp", None, "tp")}
    assert set(_pool_specs(llama, dense, TP4)) == {P(None, None, None)}  # 2 KV heads, 4 devices: whole
    assert set(_pool_specs(llama, dense, EP)) == {P("dp", None, None)}  # never over a part (tp of ep x tp)
    assert set(_pool_specs(llama, _cfg(num_attention_heads=8, num_key_value_heads=4), EP)) == {P("dp", None, "ep")}
    mla = deepseek.Config.from_hf({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                   "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
                                   "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                   "v_head_dim": 8, "vocab_size": 256, "first_k_dense_replace": 1})
    assert set(_pool_specs(deepseek, mla, TP2_DP2)) == {P("dp")}  # the latent: whole over tp, split over dp
    assert sharding.data_parallel_size(TP2_DP2) == 2 and sharding.data_parallel_size(TP4) == 1
    assert sharding.data_parallel_size(None) == 1
    with pytest.raises(ValueError, match="7 pages do not divide over 2 data-parallel ranks"):
        _pool_specs(llama, dense, TP2_DP2, num_pages=7)


def test_parallel_settings_are_checked_before_anything_loads():
    config = EngineConfig.create(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    assert config.parallel.world_size == 4 and config.parallel.sharded
    assert config.load_quantization == "none"  # a GGUF's blocks are dequantized over a mesh
    assert EngineConfig.create().load_quantization is None
    assert config.replace(tensor_parallel_size=4).parallel.tensor_parallel_size == 4
    bad = [({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer in [1, 65536], got 0"),
           ({"data_parallel_size": 1.5}, "data_parallel_size must be an integer"),
           ({"expert_tensor_parallel_size": 2, "tensor_parallel_size": 4}, "needs enable_expert_parallel"),
           ({"expert_tensor_parallel_size": 3, "tensor_parallel_size": 4, "enable_expert_parallel": True},
            "expert_tensor_parallel_size (3) must divide tensor_parallel_size (4)"),
           ({"tensor_parallel_size": 2, "nnodes": 2, "backend": "megakernel"},
            "the megakernel backend runs on one host (nnodes 1)"),
           ({"tensor_parallel_size": 2, "quantization": "int8"}, "runs on one device"),
           ({"node_rank": 2, "nnodes": 2}, "node_rank must be an integer in [0, 1]")]
    for kwargs, message in bad:
        with pytest.raises(InvalidInputError, match=re.escape(message)):
            EngineConfig.create(**kwargs)
    assert ParallelConfig().world_size == 1 and not ParallelConfig().sharded
    assert EngineConfig.create(tensor_parallel_size=2, backend="megakernel").parallel.sharded  # tensor parallel
    assert EngineConfig.create(tensor_parallel_size=2, data_parallel_size=2, backend="megakernel").parallel.sharded


def test_vllm_flag_names_choose_the_layout():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["-tp", "4", "--data-parallel-size", "2", "--enable-expert-parallel",
                         "--expert-tensor-parallel-size", "2"])
    parallel = EngineConfig.from_args(args).parallel
    assert (parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.enable_expert_parallel,
            parallel.expert_tensor_parallel_size) == (4, 2, True, 2)
    assert EngineConfig.from_args(p.parse_args([])).parallel == ParallelConfig()


def test_a_layout_that_does_not_fit_is_one_line_on_the_command_line():
    assert_clean_error(weld("generate", "hi", "--max-tokens", "1", "-tp", "2"),
                       "tensor_parallel_size 2 x data_parallel_size 1 needs 2 devices; 1 is available")
    # on 8 devices the bundled SmolLM2 (9 heads, 3 KV heads) still does not split in 2
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    os.environ, saved = env, os.environ
    try:
        proc = weld("generate", "hi", "--max-tokens", "1", "-tp", "2")
    finally:
        os.environ = saved
    assert_clean_error(proc, "tensor_parallel_size 2 does not divide the model's 9 attention heads")
