"""Runs the tensor-parallel decode megakernel (`weld.models.megakernel.sharded_forward`: in-kernel
all-reduces by remote DMA) in Pallas TPU interpret mode on N virtual CPU devices, in a process
of its own, against the one-device XLA forward, and prints one JSON line per config: the largest
relative logits error over two greedy steps, whether the greedy tokens matched, the largest
pool difference, and whether the race detector fired.

    python tests/parallel/megakernel_tp_run.py DEVICES '["dense", "moe", "moe_ep", "dense_without_all_reduce"]'
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from json_runs import interpret_races_found  # noqa: E402
from weld.kernels.megakernel import collectives  # noqa: E402
from weld.models import FAMILIES, deepseek, gemma3, gpt_oss, kimi_linear, llama, megakernel, qwen3_next  # noqa: E402
from weld.models.common import linear_attention as la  # noqa: E402
from weld.models.common.cache import RecurrentState  # noqa: E402
from weld.models.family import WeightTarget  # noqa: E402
from weld.models.common import moe as moe_lib  # noqa: E402
from weld.models.common.mla import MLA, mla_scale  # noqa: E402
from weld.models.common.rope import Rope, RopeScaling  # noqa: E402
from weld.models.common import sharding  # noqa: E402
from weld.models.common.cache import AttentionBatch  # noqa: E402
from weld.models.common.spec import random_weights  # noqa: E402

DENSE = llama.Config(architecture="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=16, num_kv_heads=8, head_dim=8, qk_norm=True, qkv_bias=True, o_bias=True,
                     rope_theta=1e6)  # an o bias: added once to the devices' sum
MOE = dataclasses.replace(DENSE, architecture="qwen3_moe", sparse_layers=(1,),
                          moe=moe_lib.MoE(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True))
# DeepSeek-V3's routing (sigmoid scores, a correction bias, group-limited) and a shared expert, on
# GQA layers: under expert parallelism the router's rows and bias are split with the experts
GROUPED = dataclasses.replace(DENSE, architecture="qwen3_moe", sparse_layers=(0, 1), moe=moe_lib.MoE(
    num_experts=8, top_k=2, intermediate_size=16, router="sigmoid_group", n_group=4, topk_group=2, score_bias=True,
    routed_scaling_factor=2.5, shared_intermediate_size=32))
# DeepSeek-V3 / Kimi K2 in miniature: MLA with q LoRA and interleaved RoPE (heads split, the
# latent replicated), a dense first layer, then the grouped routing and a shared expert
YARN = RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)
MLA_MOE = deepseek.Config(
    architecture="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3,
    mla=MLA(num_heads=8, q_lora_rank=24, kv_lora_rank=16, nope_dim=8, rope_dim=8, v_dim=12,
            rope=Rope(8, 1e4, YARN, 64, interleaved=True), scale=mla_scale(8, 8, YARN)),
    moe=GROUPED.moe, first_k_dense_replace=1)
# Qwen3-Next in miniature (3 Gated DeltaNet layers : 1 gated full-attention layer, 2 value heads
# per key head, a gated shared expert) and Kimi Linear (KDA and NoPE MLA layers, grouped routing):
# the linear layers split by head, their q/k/v channels grouped per device
LIN, FULL = "linear_attention", "full_attention"
NEXT = qwen3_next.Config(
    architecture="qwen3_next", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
    num_kv_heads=4, head_dim=16, layer_types=(LIN, LIN, LIN, FULL),
    linear=la.DeltaNet(num_k_heads=4, num_v_heads=8, k_dim=8, v_dim=8, conv_width=4), rotary_dim=4,
    moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=16, shared_intermediate_size=32, shared_gate=True),
    sparse_layers=(1, 3))
KIMI = kimi_linear.Config(
    architecture="kimi_linear", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=4,
    layer_types=(LIN, FULL, LIN, FULL),
    linear=la.DeltaNet(num_k_heads=4, num_v_heads=4, k_dim=8, v_dim=8, conv_width=4, kind="kda", norm_eps=1e-5),
    mla=MLA(num_heads=4, q_lora_rank=None, kv_lora_rank=16, nope_dim=8, rope_dim=8, v_dim=8, rope=None,
            scale=mla_scale(8, 8, RopeScaling())),
    moe=GROUPED.moe, sparse_layers=(1, 2, 3), rms_norm_eps=1e-5)
# Gemma 3 in miniature: sandwich norms (normed after the all-reduce), sliding layers of window 3
# beside a full one (two page groups, two RoPE tables), the scaled embedding, soft-capped logits
GEMMA = gemma3.Config(architecture="gemma3_text", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=8, num_kv_heads=4, head_dim=8, layer_types=(gemma3.SLIDING, gemma3.FULL, gemma3.SLIDING),
                      sliding_window=3, rope_global=Rope(8, 1e6, RopeScaling(kind="linear", factor=2.0), 64),
                      rope_local=Rope(8, 1e4, RopeScaling(), 64), query_pre_attn_scalar=12.0,
                      final_logit_softcapping=5.0)
# gpt-oss in miniature: sinks (split with the heads), q/k/v/o biases, sliding and full layers, a
# router bias, experts with biases (gate / up split with each expert's FFN; down added once per
# pair, by the first device that holds the expert) and the clamped SwiGLU
GPT_OSS = gpt_oss.Config(
    architecture="gpt_oss", vocab_size=128, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
    moe=moe_lib.MoE(num_experts=4, top_k=2, intermediate_size=16, router="topk_softmax", activation="clamped_swiglu",
                    expert_bias=True, router_bias=True, swiglu_limit=0.3),
    layer_types=("sliding_attention", "full_attention"), sliding_window=3, rope=Rope(8, 1.5e5, YARN, 64))
# name -> (config, mesh: (ep, tp) over the devices, None: a ("dp", "tp") mesh with dp 1, {"dp": n}:
# n ranks of DEVICES / n tensor-parallel devices)
CONFIGS = {"dense": (DENSE, None), "moe": (MOE, None), "dense_without_all_reduce": (DENSE, None),
           "moe_ep": (GROUPED, (2, DEVICES // 2)),  # 2 expert shards, each expert's FFN over the rest
           "moe_ep_only": (GROUPED, (DEVICES, 1)),  # every device its own experts, whole
           "moe_ep_wrong_expert": (GROUPED, (2, DEVICES // 2)),
           "moe_ep_every_pair_computed": (GROUPED, (2, DEVICES // 2)),
           "mla": (MLA_MOE, None), "mla_ep": (MLA_MOE, (2, DEVICES // 2)),
           "mla_without_all_reduce": (MLA_MOE, None),
           "gdn": (NEXT, None), "gdn_ep": (NEXT, (2, DEVICES // 2)), "kda_ep": (KIMI, (2, DEVICES // 2)),
           "gdn_flat_channels": (NEXT, None),
           # llama.cpp's Qwen3.5 order: value head p served by key head p mod 4, regrouped at load
           "gdn_tiled": (dataclasses.replace(NEXT, linear=dataclasses.replace(NEXT.linear, tiled_v_heads=True)), None),
           "gdn_tiled_not_regrouped": (dataclasses.replace(NEXT, linear=dataclasses.replace(NEXT.linear, tiled_v_heads=True)), None),
           # data parallel: 2 ranks, each its own row over its own pages, tensor parallel within
           "moe_dp": (GROUPED, {"dp": 2}), "mla_dp": (MLA_MOE, {"dp": 2}),
           # and its own block of the recurrent-state slots (rank-major global ids made local)
           "gdn_dp": (NEXT, {"dp": 2}), "kda_ep_dp": (KIMI, {"dp": 2, "ep": 2}), "gdn_dp_global_slots": (NEXT, {"dp": 2}),
           # experts over the data-parallel ranks too (expert parallelism under DP): 2 ranks x 2 expert
           # shards, each rank's tokens routed to the experts of both ranks
           "moe_ep_dp": (GROUPED, {"dp": 2, "ep": 2}), "mla_ep_dp": (MLA_MOE, {"dp": 2, "ep": 2}), "gemma3": (GEMMA, None),
           # KV heads fewer than the devices: whole pools and k / v weights on every device
           "dense_kv2": (dataclasses.replace(DENSE, num_kv_heads=2), None),
           "gdn_kv2": (dataclasses.replace(NEXT, num_kv_heads=2), None),
           "gpt_oss": (GPT_OSS, None), "gpt_oss_ep": (GPT_OSS, (2, DEVICES // 2))}
PAGE, PAGES = 4, 16
ALL_REDUCE_ROWS, DECODE_STEP, LOCAL_SLOTS = collectives.all_reduce_rows, megakernel.decode_step, sharding.local_slots
SLOTS = 4  # 2 rows in slots 1 and 2: under 2 data-parallel ranks, the last of rank 0's block and the first of rank 1's



def run(name):
    """One config; "..._without_all_reduce" plants a bug: each device keeps its own partial sums;
    "..._wrong_expert": each device fetches its shard's experts by their global ids;
    "..._every_pair_computed": each device also adds the products of the pairs whose expert it
    does not hold (never fetched: the ring slot's stale tile); "..._flat_channels": the linear
    layers' q/k/v channels left flat, not grouped per device (each device's share of w_qkv is
    then not its heads'); "..._global_slots": each data-parallel rank indexes its block of the
    state pools by the global slot ids."""
    cfg, ep_tp = CONFIGS[name]
    # each run starts from the real kernel: a planted bug lasts for its own config only
    collectives.all_reduce_rows, megakernel.decode_step, sharding.local_slots = ALL_REDUCE_ROWS, DECODE_STEP, LOCAL_SLOTS
    if name.endswith("_global_slots"):
        sharding.local_slots = lambda slots, *_: slots
    if name.endswith("_without_all_reduce"):
        def partial_only(x_ref, out_ref, *_, **__):
            out_ref[...] = x_ref[...]
        collectives.all_reduce_rows = partial_only
    bug = {"_wrong_expert": "global_expert_ids", "_every_pair_computed": "every_pair_computed"}
    planted = next((b for suffix, b in bug.items() if name.endswith(suffix)), None)
    if planted:
        megakernel.decode_step = lambda *a, **k: DECODE_STEP(*a, **k, _bug=planted)
    pltpu.reset_tpu_interpret_mode_state()
    devices = np.array(jax.devices()[:DEVICES])
    ranks = ep_tp["dp"] if isinstance(ep_tp, dict) else 1
    if isinstance(ep_tp, dict) and "ep" in ep_tp:
        mesh = Mesh(devices.reshape(ranks, ep_tp["ep"], DEVICES // (ranks * ep_tp["ep"])), ("dp", "ep", "tp"))
    elif ep_tp is None or ranks > 1:
        mesh = Mesh(devices.reshape(ranks, DEVICES // ranks), ("dp", "tp"))
    else:
        mesh = Mesh(devices.reshape(1, *ep_tp), ("dp", "ep", "tp"))
    family = next(f for f in FAMILIES if isinstance(cfg, f.Config))
    weights = random_weights(family.weight_specs(cfg), seed=0)
    for i, lw in enumerate(weights["layers"]):  # biases whose declared init is zeros: the o bias, and a
        # correction bias that moves the choices
        if "bo" in lw:
            lw["bo"] = jnp.asarray(np.random.default_rng(2 + i).normal(0, 0.5, cfg.hidden_size), jnp.float32)
        for tree in (lw, lw.get("moe", {})) if cfg is GPT_OSS else ():  # sinks and biases away from zero
            for key in [k for k in tree if k.startswith("b") or k in ("sinks", "router_bias")]:
                tree[key] = jnp.asarray(np.random.default_rng(5 + i).normal(0, 0.5, tree[key].shape), jnp.float32)
        for key in [k for k in lw if k.endswith("norm") and cfg is GEMMA]:  # (1 + w) norms away from 1
            lw[key] = jnp.asarray(np.random.default_rng(7 + i).normal(0, 0.3, lw[key].shape), jnp.float32)
        if "score_bias" in lw.get("moe", {}):
            lw["moe"]["score_bias"] = jnp.asarray(np.random.default_rng(1).normal(0, 0.5, cfg.moe.num_experts),
                                                  jnp.float32)
    tables = jnp.asarray(np.arange(PAGES).reshape(2, PAGES // 2)[:, ::-1].copy(), jnp.int32)
    tables = family.cache_spec(cfg).tables(tables)  # every page group's pool: the same page ids
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5)).astype(jnp.int32)
    cache = family.cache_spec(cfg).create(PAGES, PAGE, jnp.float32, num_slots=SLOTS)
    slots = jnp.asarray([1, 2], jnp.int32)
    xla = jax.jit(lambda w, t, p, c, bt: family.forward(w, cfg, t, p, c, AttentionBatch(bt, slots)))
    logits, _, cache = xla(weights, prompt, positions, cache, tables)
    # the kernel's model: a linear model's q/k/v channels grouped per device (weights, conv windows)
    k_cfg = megakernel.tensor_parallel_config(cfg, mesh)
    flat = name.endswith("_flat_channels")  # planted: grouped in the kernel's config, flat in the weights and windows
    order = la.stored_channels(k_cfg.linear) if hasattr(cfg, "linear") and not flat else None
    heads = la.value_head_order(k_cfg.linear) if hasattr(cfg, "linear") else None
    # planted: tiled value heads left as stored (the kernel's model shares key heads grouped)
    prep_cfg = cfg if flat else k_cfg if not name.endswith("_not_regrouped") else dataclasses.replace(
        k_cfg, linear=dataclasses.replace(k_cfg.linear, tiled_v_heads=False))
    k_weights = family.prepare_weights(jax.tree.map(lambda a: a, weights), prep_cfg, WeightTarget(backend="megakernel"))

    def grouped(c, forward=True):  # the conv windows (and regrouped value heads' states) in the kernel's order (or back)
        idx = None if order is None else order if forward else np.argsort(order)
        hidx = None if heads is None else heads if forward else np.argsort(heads)
        return type(c)(layers=[RecurrentState(conv=x.conv[:, idx], state=x.state if hidx is None else x.state[:, hidx])
                               if isinstance(x, RecurrentState) and idx is not None else x for x in c.layers])
    options = megakernel.KernelOptions(tile_rows=16, vocab_tile_rows=16, ring_depth=3, pages_per_kv_tile=2,
                                       interpret=pltpu.InterpretParams(dma_execution_mode="on_wait",
                                                                       uninitialized_memory="nan", detect_races=True))
    kernel = jax.jit(lambda w, t, p, c, bt: megakernel.sharded_forward(w, k_cfg, t, p, c, AttentionBatch(bt, slots),
                                                                       mesh=mesh, options=options))
    k_tables = tables % (PAGES // ranks)  # data parallel: row r's pages are on its rank, by local ids
    shard = lambda tree, shardings: jax.device_put(tree, shardings)  # noqa: E731
    k_cache = shard(grouped(cache), sharding.cache_shardings(cache, mesh))
    k_weights = shard(k_weights, sharding.weight_shardings(k_weights, family.weight_specs(cfg), mesh))
    tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    pos = positions[:, -1:] + 1
    errors, same = [], True
    for _ in range(2):
        ref, _, cache = xla(weights, tok, pos, cache, tables)
        got, _, k_cache = kernel(k_weights, tok, pos, k_cache, k_tables)
        errors.append(float(np.abs(np.asarray(got) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()))
        same &= bool(np.array_equal(np.argmax(np.asarray(got), -1), np.argmax(np.asarray(ref), -1)))
        tok, pos = jnp.argmax(ref[:, -1], axis=-1).astype(jnp.int32)[:, None], pos + 1
    pool_err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                   for a, b in zip(jax.tree.leaves(grouped(k_cache, forward=False)), jax.tree.leaves(cache)))
    return {"config": name, "max_rel_err": max(errors), "greedy_equal": same, "pool_err": pool_err,
            "races": interpret_races_found()}


def run_or_fail(name):
    """run(name); a planted bug the interpreter stops (an out-of-bounds DMA: a rank's global slot
    id past its block) reports as wrong numbers, with the error."""
    if not name.endswith("_global_slots"):
        return run(name)
    try:
        return run(name)
    except jax.errors.JaxRuntimeError as e:
        if "Out-of-bounds" not in str(e):
            raise
        return {"config": name, "max_rel_err": float("nan"), "greedy_equal": False, "error": str(e)[:200]}


for case in json.loads(sys.argv[2]):
    print(json.dumps(run_or_fail(case)), flush=True)
