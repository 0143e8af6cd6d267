"""The megakernel's VMEM budget and per-step HBM floor for model shapes, per TPU generation.

    python benchmarks/megakernel_budget.py [--context 1024]

Pure arithmetic on `weld.kernels.megakernel.plan` (no TPU needed): for each shape, weight type
and batch, the plan's ring, KV tiles and activations, whether it fits each generation's VMEM
(and at which ring depth), and the bytes a step must move with the time that takes at the
generation's HBM bandwidth. int8 rows keep what the families' declarations leave unquantized in
bf16 (a float ring beside the int8 one); "int8 + int4 experts" is the seeds' mix
(`--quantization int8_channel_int4_experts`: routed experts int4 with a scale and min per 128 inputs).
Then the same per device under a tensor x expert layout for each shape (`LAYOUTS`;
`MegakernelSpec.shard`), with the bytes each device sends over ICI per step. Prints markdown
tables (docs/megakernel.md holds a copy).
"""

from __future__ import annotations

import argparse

from weld.kernels.megakernel import collectives, plan

MIB = 1 << 20
# Qwen3-30B-A3B (Qwen3-MoE): 48 sparse layers, 128 experts, top-8, no shared expert
QWEN3_MOE_30B = plan.MegakernelSpec(hidden=2048, intermediate=6144, num_heads=32, num_kv_heads=4, head_dim=128,
                                    vocab=151936, num_layers=48, sparse_layers=tuple(range(48)), num_experts=128,
                                    top_k=8, expert_intermediate=768)
# Kimi K2 (DeepSeek-V3's layout): MLA (64 heads, q LoRA 1536, latent 512 + rope 64), a dense first
# layer, then 60 sparse layers of 384 experts, top-8, and a shared expert
KIMI_K2 = plan.MegakernelSpec(hidden=7168, intermediate=18432, num_heads=64, num_kv_heads=1, head_dim=512 + 64,
                              vocab=163840, num_layers=61, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                              nope_dim=128, rope_dim=64, v_dim=128, sparse_layers=tuple(range(1, 61)),
                              num_experts=384, top_k=8, expert_intermediate=2048, shared_intermediate=2048)
# Qwen3-Next-80B-A3B: 48 layers, 3 Gated DeltaNet (16 key heads of 128 serving 32 value heads of
# 128, conv 4) to 1 gated full attention (16 heads, 2 KV heads of 256, RoPE over 64 dims); every
# layer sparse: 512 experts, top-10, width 512, a gated shared expert of 512
QWEN3_NEXT_80B = plan.MegakernelSpec(
    hidden=2048, intermediate=5120, num_heads=16, num_kv_heads=2, head_dim=256, vocab=151936, num_layers=48,
    rotary_dim=64, output_gate=True, qk_norm=True, linear_layers=tuple(i for i in range(48) if i % 4 != 3),
    linear_kind="gdn", linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, conv_width=4,
    sparse_layers=tuple(range(48)), num_experts=512, top_k=10, expert_intermediate=512, shared_intermediate=512,
    shared_expert_gate=True)
# Kimi-Linear-48B-A3B: 27 layers, KDA (32 heads of 128, conv 4) with NoPE MLA (32 heads, latent
# 512 + 64, no q LoRA) on layers 4, 8, ..., 24 and 27 (1-indexed); a dense first layer, then 256
# experts, top-8, width 1024, a shared expert
KIMI_LINEAR_48B = plan.MegakernelSpec(
    hidden=2304, intermediate=9216, num_heads=32, num_kv_heads=1, head_dim=512 + 64, vocab=163840, num_layers=27,
    attention="mla", kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128, rope=False,
    linear_layers=tuple(i for i in range(27) if i not in (3, 7, 11, 15, 19, 23, 26)), linear_kind="kda",
    linear_k_heads=32, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, conv_width=4,
    sparse_layers=tuple(range(1, 27)), num_experts=256, top_k=8, expert_intermediate=1024, shared_intermediate=1024)
SHAPES = {"Qwen3-30B-A3B (MoE)": QWEN3_MOE_30B, "Kimi-K2 (MLA + MoE)": KIMI_K2,
          "Qwen3-Next-80B-A3B (GDN 3:1 + MoE)": QWEN3_NEXT_80B, "Kimi-Linear-48B-A3B (KDA 3:1 MLA + MoE)": KIMI_LINEAR_48B}
# a tensor x expert layout for each (ep, tp): the tensor-parallel devices ep x tp, the experts over
# ep. Kimi K2 as the seeds run it (TP4 x EP8: attention over all 32 chips); Qwen3-Next's 2 KV heads
# allow 2 tensor-parallel devices at most (the kernel splits KV heads, never replicates them)
LAYOUTS = {"Qwen3-30B-A3B (MoE)": (4, 1), "Kimi-K2 (MLA + MoE)": (8, 4),
           "Qwen3-Next-80B-A3B (GDN 3:1 + MoE)": (2, 1), "Kimi-Linear-48B-A3B (KDA 3:1 MLA + MoE)": (8, 1)}


def unquantized(spec: plan.MegakernelSpec) -> tuple[str, ...]:
    """The matrices an int8 load leaves bf16, as the families declare them: MLA's W_UK / W_UV,
    linear attention's beta and decay projections (and KDA's low-rank pairs)."""
    names = {name for layer in range(spec.num_layers) for name, _, _ in spec.matrices(layer)}
    return tuple(sorted(names & {"w_uk", "w_uv", "w_b", "w_a", "w_fa", "w_fb", "w_ga", "w_gb"}))


def ici_bytes(spec: plan.MegakernelSpec, devices: int) -> int:
    """Bytes one device sends per step over ICI in a tensor-parallel kernel: the all-reduce of the
    embedding rows and of every layer's two partial outputs (f32 [N, d]), and under expert
    parallelism each sparse layer's gathered scores (f32 [N (+1), E]), each as
    `collectives.all_reduce_rows` sends it (reduce-scatter + all-gather past 2 devices)."""
    reduce = (1 + 2 * spec.num_layers) * collectives.sent_bytes(spec.tokens, spec.hidden, devices)
    rows = spec.tokens + (1 if spec.router_bias else 0)
    scores = len(spec.sparse_layers) * collectives.sent_bytes(rows, spec.routed_experts, devices)
    return reduce + (scores if spec.expert_shards > 1 else 0)


def rows(context: int, sharded: bool = False):
    for name, full in SHAPES.items():
        ep, tp = LAYOUTS[name] if sharded else (1, 1)
        base = full.shard(ep * tp, ep)
        for weights, wb, sb, int4 in (("bf16", 2, 0, False), ("int8", 1, 4, False), ("int8 + int4 experts", 1, 4, True)):
            for batch in (1, 8):
                floats = dict(float_matrices=unquantized(base), float_bytes=2) if sb else {}
                spec = plan.MegakernelSpec(**{**base.__dict__, "weight_bytes": wb, "scale_bytes": sb, "batch": batch,
                                              "int4_experts": int4, **floats})
                fits = []
                for gen in plan.TPU_GENERATIONS:
                    try:
                        p = plan.fit_plan(spec, gen)
                        fits.append(f"depth {p.ring_depth} ({p.vmem_bytes / p.vmem_limit_bytes:.0%} of "
                                    f"{p.vmem_limit_bytes / MIB:.1f} MiB)")
                    except plan.VmemBudgetError:
                        fits.append("does not fit")
                p = plan.make_plan(spec)
                step = plan.step_bytes(spec, context)
                floors = [plan.step_floor_seconds(spec, gen, context) * 1e3 for gen in plan.TPU_GENERATIONS]
                label = f"{name}, ep {ep} x tp {tp}" if sharded else name
                yield (label, weights, batch, len(p.tiles), p.ring_bytes / MIB, p.kv_bytes / MIB,
                       p.activation_bytes / MIB, p.vmem_bytes / MIB, fits, step / 1e9, floors,
                       ici_bytes(spec, ep * tp) / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    gens = list(plan.TPU_GENERATIONS)
    for sharded in (False, True):
        if sharded:
            print("Per device, tensor x expert parallel (the megakernel's in-kernel all-reduces; a pair's "
                  "expert read only where it is held: the expected 1 / ep of the pairs):\n")
        print("| model | weights | batch | tiles/step | ring | KV tiles | activations | total | "
              + " | ".join(gens) + " |")
        print("|---" * (8 + len(gens)) + "|")
        table = list(rows(args.context, sharded))
        for name, weights, batch, tiles, ring, kv, act, total, fits, *_ in table:
            print(f"| {name} | {weights} | {batch} | {tiles} | {ring:.2f} MiB | {kv:.2f} MiB | {act:.2f} MiB | "
                  f"{total:.2f} MiB | " + " | ".join(fits) + " |")
        print()
        ici = " ICI sent/step |" if sharded else ""
        print(f"| model | weights | batch | context | bytes/step |{ici} " + " | ".join(f"floor {g}" for g in gens)
              + " |")
        print("|---" * (5 + len(gens) + bool(sharded)) + "|")
        for name, weights, batch, *_, step, floors, sent in table:
            print(f"| {name} | {weights} | {batch} | {args.context} | {step:.3f} GB |"
                  + (f" {sent:.1f} MB |" if sharded else "") + " " + " | ".join(f"{f:.3f} ms" for f in floors)
                  + " |")
        print()


if __name__ == "__main__":
    main()
