"""Lowers the decode megakernel to Mosaic (the TPU kernel dialect) on this machine, with no TPU:
which families' kernels Pallas can lower, and how long lowering takes at full model depth.

    python benchmarks/megakernel_lowering.py [--generation v6e] [--batch 8] [--out FILE.json]

`weld.models.megakernel.lower_for_tpu` runs the Pallas -> Mosaic lowering of one decode step
(every op of the kernel body must have a Mosaic rule: what `interpret` mode never checks) with
abstract weights, so nothing is allocated. Mosaic's own passes (vector layouts, VMEM allocation,
the LLO compile) run in libtpu at compile time and need a TPU: lowering is necessary, not
sufficient.

The tiny configs are every covered family's switches at TPU-friendly widths (hidden 256, head dim
128); the full-depth ones are real models' layer stacks (weights abstract), whose unrolled
schedules are tens of thousands of tiles: lowering time grows with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax

from weld.models import deepseek, gemma3, gpt_oss, kimi_linear, llama, megakernel, qwen3_next
from weld.models.common import linear_attention as la
from weld.models.common import moe as moe_lib
from weld.models.common.mla import MLA, mla_scale
from weld.models.common.rope import Rope, RopeScaling

LIN, FULL = "linear_attention", "full_attention"

LLAMA = llama.Config(architecture="llama", vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=128)
QWEN3_MOE = dataclasses.replace(LLAMA, architecture="qwen3_moe", qk_norm=True, sparse_layers=(1,),
                                moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=256))
DEEPSEEK = deepseek.Config(
    architecture="deepseek_v3", vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=2,
    mla=MLA(num_heads=4, q_lora_rank=256, kv_lora_rank=128, nope_dim=128, rope_dim=64, v_dim=128,
            rope=Rope(64, 1e4, RopeScaling(), 4096, interleaved=True),
            scale=mla_scale(128, 64, RopeScaling())),
    moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=256, router="sigmoid_group", n_group=4, topk_group=2,
                    score_bias=True, shared_intermediate_size=256), first_k_dense_replace=1)
QWEN3_NEXT = qwen3_next.Config(
    architecture="qwen3_next", vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=128, layer_types=(LIN, LIN, LIN, FULL),
    linear=la.DeltaNet(num_k_heads=2, num_v_heads=4, k_dim=128, v_dim=128, conv_width=4), rotary_dim=64,
    moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=256, shared_intermediate_size=256, shared_gate=True),
    sparse_layers=(1, 3))
KIMI_LINEAR = kimi_linear.Config(
    architecture="kimi_linear", vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=4,
    layer_types=(LIN, FULL, LIN, FULL),
    linear=la.DeltaNet(num_k_heads=2, num_v_heads=2, k_dim=128, v_dim=128, conv_width=4, kind="kda"),
    mla=MLA(num_heads=4, q_lora_rank=None, kv_lora_rank=128, nope_dim=128, rope_dim=64, v_dim=128, rope=None,
            scale=mla_scale(128, 64, RopeScaling())),
    moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=256, router="sigmoid_group", n_group=2, topk_group=1,
                    score_bias=True, shared_intermediate_size=256), sparse_layers=(1, 2, 3))
GEMMA3 = gemma3.Config(architecture="gemma3_text", vocab_size=2048, hidden_size=256, intermediate_size=512, num_layers=6,
                       num_heads=4, num_kv_heads=1, head_dim=128, layer_types=(gemma3.SLIDING,) * 5 + (gemma3.FULL,),
                       sliding_window=512, rope_global=Rope(128, 1e6, RopeScaling(kind="linear", factor=8.0), 4096),
                       rope_local=Rope(128, 1e4, RopeScaling(), 4096), query_pre_attn_scalar=128.0)
GPT_OSS = gpt_oss.Config(
    architecture="gpt_oss", vocab_size=2048, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
    moe=moe_lib.MoE(num_experts=8, top_k=2, intermediate_size=256, router="topk_softmax", activation="clamped_swiglu",
                    expert_bias=True, router_bias=True),
    layer_types=("sliding_attention", "full_attention"), sliding_window=128,
    rope=Rope(128, 1.5e5, RopeScaling(kind="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False),
              4096))
# full depth: Llama-3-8B's, Qwen3-30B-A3B's and Kimi K2's layer stacks
LLAMA_8B = dataclasses.replace(LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                               num_heads=32, num_kv_heads=8)
QWEN3_30B = dataclasses.replace(QWEN3_MOE, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                                num_heads=32, num_kv_heads=4, sparse_layers=tuple(range(48)),
                                moe=moe_lib.MoE(num_experts=128, top_k=8, intermediate_size=768))
KIMI_K2 = dataclasses.replace(
    DEEPSEEK, vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_layers=61,
    mla=MLA(num_heads=64, q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128,
            rope=Rope(64, 5e4, RopeScaling(), 4096, interleaved=True), scale=mla_scale(128, 64, RopeScaling())),
    moe=moe_lib.MoE(num_experts=384, top_k=8, intermediate_size=2048, router="sigmoid_group", n_group=1, topk_group=1,
                    score_bias=True, norm_topk_prob=True, routed_scaling_factor=2.827, shared_intermediate_size=2048),
    first_k_dense_replace=1)
CASES = {"llama (dense)": (LLAMA, 2), "qwen3_moe (MoE)": (QWEN3_MOE, 2), "deepseek_v3 (MLA + MoE)": (DEEPSEEK, 2),
         "qwen3_next (GDN 3:1 + MoE)": (QWEN3_NEXT, 2), "kimi_linear (KDA + NoPE MLA + MoE)": (KIMI_LINEAR, 2),
         "gemma3 (sliding + full, sandwich norms)": (GEMMA3, 2), "gpt_oss (sinks, biased experts)": (GPT_OSS, 2),
         "Llama-3-8B, 32 layers": (LLAMA_8B, 2), "Qwen3-30B-A3B, 48 layers": (QWEN3_30B, 2),
         "Kimi-K2-like, 61 layers": (KIMI_K2, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generation", default="v6e", choices=sorted(megakernel.TPU_CHIPS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="cases whose name contains this")
    args = parser.parse_args()
    rows = []
    print("| kernel | layers | batch | lowered to Mosaic | lowering time | module |\n|---|---|---|---|---|---|")
    for name, (cfg, _) in CASES.items():
        if args.only and args.only not in name:
            continue
        try:
            start = time.perf_counter()
            size = len(megakernel.lower_for_tpu(cfg, batch=args.batch, generation=args.generation))
            seconds = time.perf_counter() - start
            row = dict(kernel=name, layers=cfg.num_layers, batch=args.batch, ok=True, seconds=round(seconds, 2),
                       module_chars=size)
            print(f"| {name} | {cfg.num_layers} | {args.batch} | yes | {seconds:.2f} s | {size / 1e6:.1f} M chars |")
        except Exception as err:  # a missing Mosaic rule: report it, go on
            message = str(err).splitlines()[0][:200]
            row = dict(kernel=name, layers=cfg.num_layers, batch=args.batch, ok=False, error=message)
            print(f"| {name} | {cfg.num_layers} | {args.batch} | no: {type(err).__name__}: {message} | | |")
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                       "jax": jax.__version__, "generation": args.generation, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
