"""The decode megakernel tensor-parallel (`weld.models.megakernel.sharded_forward`) on 4 and 8
virtual CPU devices in Pallas TPU interpret mode, each run in a subprocess
(`megakernel_tp_run.py`): every device streams its shard of the weights (its heads, its slice of
the MLP, expert and vocabulary rows, as the sharding rules lay them out) and its KV heads' pools,
and the kernel all-reduces by remote DMA the embedding rows and every attention's and MLP's
(experts included) partial outputs. Under expert parallelism (a ("dp", "ep", "tp") mesh) each
device holds a shard of the experts and of the router: the scores are gathered in the kernel,
only the device's own chosen experts are fetched and multiplied, and the all-reduce combines
the experts' outputs. MLA splits its query heads (W_UK, W_UV and o with them); the latent and its rotary key
are computed alike on every device, each writing its own copy of the latent pool. Linear
attention (Gated DeltaNet, KDA) splits its key and value heads, with the fused q/k/v channels
(w_qkv, the conv, its windows) grouped per device (`DeltaNet.shards`). Under data parallelism
(2 ranks of 2) each rank runs its own row over its own pages and its own block of the
recurrent-state slots. Two greedy steps equal the one-device XLA forward (logits within 1e-3, the same tokens,
the pools); without the all-reduce, or with a shard's experts addressed by their global ids
the products of experts another device holds added from the ring's stale tiles, the q/k/v
channels left flat, or a rank's state slots addressed by their global ids (planted bugs), they
do not."""

from __future__ import annotations

import json
import pytest
from json_runs import run_script


def _run(devices: int, configs: list[str]) -> dict:
    return {row["config"]: row for row in run_script("megakernel_tp_run.py", str(devices), json.dumps(configs))}


@pytest.mark.parametrize("devices,configs", [
    # the default suite: each kind of layer under expert parallelism, and a planted bug (through
    # the engine, test_sharded_engine.py runs the kernel over tp x ep in the default suite and
    # over tp x dp in the slow set)
    # (KDA stands for Gated DeltaNet's grouped channels here; Gemma 3 under TP runs in the slow set)
    # and linear-attention state slots over the data-parallel ranks
    (4, ["moe_ep", "mla_ep", "kda_ep", "gdn_dp", "moe_ep_wrong_expert"]),
    # the slow set adds gpt-oss, KV heads fewer than the devices (whole on each), experts over the
    # data-parallel ranks, and the plain layouts
    # (a planted bug the interpreter stops with an out-of-bounds DMA ends its process: last)
    pytest.param(4, ["gpt_oss_ep", "dense_kv2", "moe_ep_dp",
                     "dense", "moe", "mla", "gdn", "gdn_ep", "gdn_kv2", "gemma3", "gpt_oss", "moe_dp", "mla_dp", "mla_ep_dp",
                     "kda_ep_dp", "dense_without_all_reduce",
                     "gdn_tiled", "moe_ep_every_pair_computed", "gdn_flat_channels", "gdn_tiled_not_regrouped",
                     "gdn_dp_global_slots"], marks=pytest.mark.slow),
    pytest.param(8, ["dense", "moe_ep", "moe_ep_only", "mla", "mla_ep", "mla_without_all_reduce"],
                 marks=pytest.mark.slow)])
def test_tensor_parallel_megakernel_equals_one_device_xla(devices, configs):
    result = _run(devices, configs)
    for name in configs:
        row = result[name]
        if name.endswith(("_without_all_reduce", "_wrong_expert", "_every_pair_computed", "_flat_channels",
                          "_global_slots", "_not_regrouped")):
            # NaN counts as wrong: a planted bug may read ring slots nothing has written yet
            assert not row["max_rel_err"] <= 1e-2 and not row["greedy_equal"], row
        else:
            assert row["max_rel_err"] < 1e-3 and row["greedy_equal"] and row["pool_err"] < 1e-4, row
            assert not row["races"], row



def test_layouts_the_kernel_cannot_split_are_refused_in_one_line():
    """Before anything loads (`LLM` calls `check_mesh`): uneven shards, and meshes the kernel
    does not cover, name what does not fit."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from weld.models import llama, megakernel
    from weld.models.common import moe as moe_lib

    cfg = llama.Config(architecture="qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, sparse_layers=(1,),
                       moe=moe_lib.MoE(num_experts=6, top_k=2, intermediate_size=16))
    mesh = jax.sharding.AbstractMesh
    assert megakernel.tensor_layout(mesh((1, 2, 2), ("dp", "ep", "tp"))) == (("ep", "tp"), 4, 2)
    assert megakernel.tensor_layout(mesh((1, 2, 1), ("dp", "ep", "tp"))) == ("ep", 2, 2)
    megakernel.check_mesh(cfg, mesh((1, 2), ("dp", "tp")))  # fits
    local = megakernel.local_config(dataclasses.replace(cfg, num_kv_heads=4), 4, 2)  # 2 shards of experts, each
    # expert's FFN over 2 devices; the experts stay counted whole (the router sees them all)
    assert (local.num_heads, local.num_kv_heads, local.moe.num_experts, local.moe.intermediate_size,
            local.vocab_size) == (1, 1, 6, 8, 32)
    megakernel.check_mesh(cfg, mesh((1, 2, 2), ("dp", "ep", "tp")))  # 2 KV heads over 4 devices: whole on each
    assert megakernel.local_config(cfg, 4, 2).num_kv_heads == 1  # each device attends with one of them
    with pytest.raises(ValueError, match=r"do not split: 3 KV heads \(whole on every device\) into 4 devices$"):
        megakernel.check_mesh(dataclasses.replace(cfg, num_heads=12, num_kv_heads=3), mesh((1, 2, 2), ("dp", "ep", "tp")))
    with pytest.raises(ValueError, match=r"num_experts 6 over 4 devices"):
        megakernel.check_mesh(dataclasses.replace(cfg, num_kv_heads=4), mesh((1, 4, 1), ("dp", "ep", "tp")))
    megakernel.check_mesh(cfg, mesh((2, 2), ("dp", "tp")))  # data parallel: each rank its own rows
    assert megakernel.tensor_layout(mesh((4, 1), ("dp", "tp"))) == (None, 1, 1)
    # expert parallelism under data parallelism: the experts over the ranks too (8 = 2 ranks x 2 shards x 2)
    eight = dataclasses.replace(cfg, num_kv_heads=4, moe=dataclasses.replace(cfg.moe, num_experts=8))
    megakernel.check_mesh(eight, mesh((2, 2, 1), ("dp", "ep", "tp")))
    assert megakernel.expert_ranks(eight, mesh((2, 2, 1), ("dp", "ep", "tp"))) == 2
    assert megakernel.expert_ranks(eight, mesh((2, 2), ("dp", "tp"))) == 1  # no expert parallelism: no split
    assert megakernel.local_config(eight, 2, 2, 2).moe.num_experts == 8  # counted whole; the spec takes 1/4
    with pytest.raises(ValueError, match=r"num_experts 6 over 4 devices"):
        megakernel.check_mesh(dataclasses.replace(cfg, num_kv_heads=4), mesh((2, 2, 1), ("dp", "ep", "tp")))
    from weld.models import deepseek, qwen3_next
    from weld.models.common import linear_attention as la
    from weld.models.common.mla import MLA
    from weld.models.common.rope import Rope

    mla = deepseek.Config(architecture="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64,
                          num_layers=2, mla=MLA(num_heads=8, q_lora_rank=24, kv_lora_rank=16, nope_dim=8, rope_dim=8,
                                                v_dim=12, rope=Rope(8, 1e4), scale=0.25),
                          moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=16, shared_intermediate_size=32),
                          first_k_dense_replace=1)
    local = megakernel.local_config(mla, 4, 2)  # MLA: the query heads split, the latent whole
    assert (local.mla.num_heads, local.mla.kv_lora_rank, local.intermediate_size, local.moe.intermediate_size) == \
        (2, 16, 16, 8)
    with pytest.raises(ValueError, match=r"do not split: num_heads 8 over 16 devices$"):
        megakernel.local_config(mla, 16)
    hybrid = qwen3_next.Config(
        architecture="qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, layer_types=("linear_attention", "full_attention"),
        linear=la.DeltaNet(num_k_heads=2, num_v_heads=4, k_dim=8, v_dim=12, conv_width=4), rotary_dim=4)
    local = megakernel.local_config(hybrid, 2)  # linear layers: key and value heads split
    assert (local.linear.num_k_heads, local.linear.num_v_heads, local.linear.shards, local.num_heads) == (1, 2, 1, 2)
    assert megakernel.tensor_parallel_config(hybrid, mesh((1, 2), ("dp", "tp"))).linear.shards == 2
    megakernel.check_mesh(hybrid, mesh((2, 2), ("dp", "tp")))  # each rank its own block of the state slots
    # the budget's rule in the kernel's terms (`MegakernelSpec.shard`) is local_config's
    for model, tensor, shards, ranks in ((cfg, 2, 1, 1), (dataclasses.replace(cfg, num_kv_heads=4), 4, 2, 1),
                                         (mla, 4, 2, 1), (mla, 8, 8, 1), (hybrid, 2, 1, 1), (cfg, 4, 2, 1),
                                         (dataclasses.replace(hybrid, num_kv_heads=1), 2, 1, 1), (eight, 2, 2, 2),
                                         (mla, 2, 2, 2)):
        local = megakernel.local_config(model, tensor, shards, ranks)
        whole_kv = model.num_kv_heads if not getattr(model, "mla", None) and model.num_kv_heads < tensor else 0
        want = megakernel.spec_for(local, batch=2, page_size=4, weight_dtype=jnp.float32, kv_dtype=jnp.float32,
                                   expert_shards=shards * ranks if model.moe else 1, moe_ranks=ranks,
                                   kv_pool_heads=whole_kv)
        whole = megakernel.spec_for(model, batch=2, page_size=4, weight_dtype=jnp.float32, kv_dtype=jnp.float32)
        assert whole.shard(tensor, shards, ranks) == want, (model.architecture, tensor, shards, ranks)
    # tiled value heads (llama.cpp's Qwen3.5 order) split too: regrouped by key head in the layout
    tiled = dataclasses.replace(hybrid, linear=dataclasses.replace(hybrid.linear, tiled_v_heads=True))
    megakernel.check_mesh(tiled, mesh((1, 2), ("dp", "tp")))
    k_tiled = megakernel.tensor_parallel_config(tiled, mesh((1, 2), ("dp", "tp")))
    assert k_tiled.linear.tiled_v_heads and not k_tiled.linear.tiled_sharing
    assert not megakernel.local_config(k_tiled, 2).linear.tiled_v_heads
