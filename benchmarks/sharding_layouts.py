"""Parallel layouts of large models, computed from weld's own declarations: per-device weight
and cache bytes, and the collectives of one decode step.

    python benchmarks/sharding_layouts.py [--out-dir benchmarks/results] [--date 2026-12-02]

Nothing here is a hand number. Each model is the family's `Config.from_hf` of a public
config.json (written below: no downloads); each layout is the mesh `sharding.make_mesh` builds,
as a `jax.sharding.AbstractMesh` (no devices needed); every weight's per-device shape is its
`NamedSharding(mesh, sharding.partition(...)).shard_shape` as `sharding.weight_shardings` lays
it out from the family's `weight_specs`, and every cache layer's is `sharding.cache_shardings`'
of the family's `cache_spec`. `sharding.check_layout` refuses layouts the model does not
divide over (the table says why).

Bytes:
- weights bf16: 2 bytes per element of each device's shard of every declared leaf;
- weights int8: leaves declared `quantize` ("linear", "head") as "int8_channel" (1 byte per
  element plus one f32 scale per output row), the rest bf16. weld runs quantized weights on one
  device only today; this column is what the same rules would give them;
- KV / latent per token: the bf16 K/V (or MLA latent c_kv + k_pe) of one token across every
  paged layer, on one device, averaged over the whole cache: with data-parallel attention each
  dp rank holds its own pages (the pools split along their pages over dp), so a device holds
  1/dp of the cache's tokens and this shrinks with dp; recurrent state per sequence: f32 conv
  window + state matrix of every linear-attention layer, on one device (the state slots are
  not split over dp: every rank holds every sequence's state).

Collectives of one decode step, per device, from the shardings (where GSPMD must put one) and
`moe.routed_experts` (the one psum of the expert-parallel shard_map). B rows in the step; a dp
rank runs ceil(B / dp) of them (its own sequences, `weld.engine.batch.rank_rows`). Activations bf16 (2 bytes), the
expert psum f32 (as `routed_experts` sums). Ring algorithms: an all-reduce of S bytes over g
devices sends 2 (g - 1) / g * S per device (reduce-scatter, then all-gather); an all-gather to
S bytes per device receives (g - 1) / g * S.
- attention / linear-attention output: `wo` / `w_out` split on its input (heads) -> all-reduce
  [B/dp, d] over the devices splitting it;
- dense MLP and shared expert: `w_down` split on its input -> all-reduce [B/dp, d];
- routed experts without expert parallelism: each expert's FFN split (`expert_mlp`) ->
  all-reduce [B/dp, d] (assumed placed once per layer, after the combine);
- routed experts with expert parallelism: the router [E, d] is split over the expert devices
  -> all-gather of the logits [B, E] f32 (softmax routers also all-reduce their max and sum
  [B]); the shard_map takes x whole (an all-gather of x over dp when dp > 1 split the rows) and
  ends in one psum of [B, d] f32 over every device holding a piece of the experts (dp x ep x
  expert tp);
- GQA K/V: when `wk`/`wv` are split over more devices than the cache's KV heads (fewer KV heads
  than devices: the cache replicates them) -> all-gather of k and v [B/dp, kv_heads x head_dim];
- linear attention: the conv window is replicated while the q/k/v projection is split -> all-
  gather of its output [B/dp, conv channels];
- per step: the vocab-split input embedding -> all-reduce [B/dp, d] (masked lookup); the vocab-
  split LM head -> all-gather of the logits [B/dp, V] (bf16; twice that if gathered after the
  sampler's f32 cast).
Latency, not bytes, bounds these at batch 1 (a few KB each): the count of collectives per step
is in the table too. These are the placements the shardings call for; what XLA's partitioner
compiled from them on 8 CPU devices (`benchmarks/sharding.py`) has these per step and more
(gathers inside attention's tile loop at batch 1, re-layouts of tp-split experts per call, whole
K/V pools gathered when KV heads are fewer than devices): see docs/sharding.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding

from weld.models import deepseek, llama, qwen3_next
from weld.models.common import sharding
from weld.models.common.cache import KVPages, LatentPages, RecurrentState
from weld.models.common.spec import abstract_weights, iter_specs

HERE = pathlib.Path(__file__).resolve().parent
ACT = 2  # bf16 activations
GIB = 2 ** 30

# Public config.json files (the fields that shape the model; FP8 quantization_config entries
# left out: the bytes below are for bf16 / int8 weights).
KIMI_K2 = {  # moonshotai/Kimi-K2-Instruct (model_type kimi_k2: DeepSeek-V3's architecture)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 0,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
    "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "bos_token_id": 163584, "eos_token_id": 163585,
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 (the MTP layer, num_nextn_predict_layers 1, is not served)
    **KIMI_K2, "model_type": "deepseek_v3", "vocab_size": 129280, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
    "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0, "eos_token_id": 1,
}
QWEN3_NEXT_80B = {  # Qwen/Qwen3-Next-80B-A3B-Instruct
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000,
    "partial_rotary_factor": 0.25, "tie_word_embeddings": False, "attention_bias": False, "decoder_sparse_step": 1,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
    "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": [], "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN3_235B = {  # Qwen/Qwen3-235B-A22B
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "max_window_layers": 94, "bos_token_id": 151643, "eos_token_id": 151645,
}
MODELS = {  # name -> (family module, public config it is, config dict)
    "Kimi K2": (deepseek, "moonshotai/Kimi-K2-Instruct", KIMI_K2),
    "DeepSeek-V3": (deepseek, "deepseek-ai/DeepSeek-V3", DEEPSEEK_V3),
    "Qwen3-Next-80B-A3B": (qwen3_next, "Qwen/Qwen3-Next-80B-A3B-Instruct", QWEN3_NEXT_80B),
    "Qwen3-235B-A22B": (llama, "Qwen/Qwen3-235B-A22B", QWEN3_235B),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout in weld's settings (`ParallelConfig` / the LLM keywords)."""

    name: str
    tp: int
    dp: int = 1
    ep: bool = False
    etp: int | None = None

    @property
    def flags(self) -> str:
        out = f"-tp {self.tp}" + (f" -dp {self.dp}" if self.dp > 1 else "")
        if self.ep:
            out += " --enable-expert-parallel" + (f" --expert-tensor-parallel-size {self.etp}" if self.etp else "")
        return out

    def mesh(self) -> AbstractMesh:
        """The mesh `sharding.make_mesh` builds for these settings, without devices."""
        if self.ep:
            etp = self.etp or 1
            return AbstractMesh((self.dp, self.tp // etp, etp), ("dp", "ep", "tp"))
        return AbstractMesh((self.dp, self.tp), ("dp", "tp"))


LAYOUTS = (
    Layout("1 device", 1),
    Layout("TP4 x EP8, 32 devices (the seeds' Kimi K3 layout)", 32, ep=True, etp=4),
    Layout("TP32, 32 devices", 32),
    Layout("TP8, one host", 8),
    Layout("TP8 x EP8, dp 1", 8, ep=True),
    Layout("TP4 x DP2", 4, dp=2),
    Layout("TP8 x DP4, experts over 32 (data-parallel attention)", 8, dp=4, ep=True),
)


def split_axes(s: NamedSharding, dim: int) -> tuple[str, ...]:
    entry = tuple(s.spec)[dim] if dim < len(tuple(s.spec)) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def size(mesh: AbstractMesh, axes: tuple[str, ...]) -> int:
    return sharding.axis_size(mesh, axes) if axes else 1


def weight_bytes(specs: Any, shards: dict) -> dict:
    """Per-device bytes of the weights (bf16, int8_channel where declared quantizable), total and
    by part (routed experts, the rest), plus the unsharded bf16 total."""
    out = {"bf16": 0, "int8": 0, "experts_bf16": 0, "whole_bf16": 0}
    for path, spec in iter_specs(specs):
        local = shards[path].shard_shape(spec.shape)
        n = math.prod(local)
        bf16 = 2 * n
        int8 = n + 4 * math.prod(local[:-1]) if spec.quantize else bf16
        out["bf16"] += bf16
        out["int8"] += int8
        out["whole_bf16"] += 2 * math.prod(spec.shape)
        if "moe" in path and path[-1] in ("w_gate", "w_up", "w_down"):
            out["experts_bf16"] += bf16
    return out


def cache_bytes(family, cfg, mesh) -> tuple[dict, list]:
    """Per-device cache bytes: bf16 K/V or latent per token (all paged layers), f32 recurrent
    state per sequence (all linear layers); and each layer's local shard shapes."""
    spec = family.cache_spec(cfg)
    ranks = sharding.data_parallel_size(mesh)  # one page of one token per data-parallel rank
    cache = jax.eval_shape(lambda: spec.create(ranks, 1, jnp.bfloat16, num_slots=1 if spec.has_recurrent else 0))
    layouts = sharding.cache_shardings(cache, mesh)
    per_token = per_seq = 0
    layers = []
    for layer, lay in zip(cache.layers, layouts.layers):
        if isinstance(layer, KVPages):
            k = lay.k.shard_shape(layer.k.shape)
            per_token += 2 * 2 * math.prod(k) / ranks
            layers.append({"kind": "kv", "kv_heads_local": k[2] * layer.kv_heads // layer.k.shape[2],
                           "kv_heads": layer.kv_heads})
        elif isinstance(layer, LatentPages):
            per_token += 2 * math.prod(lay.pool.shard_shape(layer.pool.shape)) / ranks
            layers.append({"kind": "latent", "whole_over_tensor": True, "split_over_dp": ranks})
        elif isinstance(layer, RecurrentState):
            conv, state = lay.conv.shard_shape(layer.conv.shape), lay.state.shard_shape(layer.state.shape)
            per_seq += 4 * (math.prod(conv) + math.prod(state))
            layers.append({"kind": "recurrent", "heads_local": state[1], "heads": layer.state.shape[1]})
    return {"kv_per_token": per_token, "recurrent_per_sequence": per_seq}, layers


def all_reduce(nbytes: float, g: int) -> float:
    return 2 * (g - 1) / g * nbytes if g > 1 else 0.0


def all_gather(nbytes_out: float, g: int) -> float:
    return (g - 1) / g * nbytes_out if g > 1 else 0.0


def step_collectives(cfg, specs, shards: dict, cache_layers: list, mesh, batch: int) -> dict:
    """The collectives of one decode step of `batch` rows, per device: a list of (what, op, group
    size, bytes sent per device) per kind, summed; see the module docstring for the rules."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    dp = sizes.get("dp", 1)
    rows = -(-batch // dp)  # the rows each dp rank runs: its own sequences (`batch.rank_rows`)
    d = cfg.hidden_size
    ops: list[dict] = []

    def add(what: str, op: str, g: int, nbytes: float, layers: int = 1):
        if g > 1:
            cost = all_reduce(nbytes, g) if op == "all-reduce" else all_gather(nbytes, g)
            ops.append({"what": what, "op": op, "group": g, "count": layers, "bytes": cost * layers})

    spec_of = dict(iter_specs(specs))
    by_kind: dict[tuple, int] = {}  # identical layers grouped: (what, op, g, bytes) -> count
    for i in range(cfg.num_layers):
        lw = ("layers", i)
        layer_ops: list[tuple] = []

        def note(what, op, g, nbytes):
            if g > 1:
                layer_ops.append((what, op, g, nbytes))

        out = lw + (("w_out",) if lw + ("w_out",) in shards else ("wo",))
        note("attention output [B, d]", "all-reduce", size(mesh, split_axes(shards[out], 1)), rows * d * ACT)
        if lw + ("wk",) in shards:  # GQA: K/V projected split, cached over fewer devices
            w = size(mesh, split_axes(shards[lw + ("wk",)], 0))
            kv = cache_layers[i]
            c = kv["kv_heads"] // kv["kv_heads_local"]  # devices the cache's KV heads are split over
            kv_dim = spec_of[lw + ("wk",)].shape[0]
            if w > c:
                note("K and V gather [B, 2 kv]", "all-gather", w // c, 2 * rows * kv_dim // c * ACT)
        for name in ("w_qkv", "w_q"):  # linear attention: the replicated conv window takes all channels
            if lw + (name,) in shards:
                net = cfg.linear
                note("conv input gather [B, C]", "all-gather", size(mesh, split_axes(shards[lw + (name,)], 0)),
                     rows * net.conv_channels * ACT)
                break
        if lw + ("moe", "router") in shards:
            moe = cfg.moe
            ex = sharding.mesh_axes(mesh, "experts")
            if ex:
                r = size(mesh, split_axes(shards[lw + ("moe", "router")], 0))
                if moe.router.startswith("softmax"):  # a softmax over the split logits: their max and sum
                    note("router softmax max [B] f32", "all-reduce", r, batch * 4)
                    note("router softmax sum [B] f32", "all-reduce", r, batch * 4)
                note("router logits gather [B, E] f32", "all-gather", r, batch * moe.num_experts * 4)
                if dp > 1:
                    note("expert input gather over dp [B, d]", "all-gather", dp, batch * d * ACT)
                stack = shards[lw + ("moe", "w_down")]
                inner = tuple(a for dim in (1, 2) for a in split_axes(stack, dim))
                note("expert combine psum [B, d] f32", "all-reduce", size(mesh, tuple(ex) + inner), batch * d * 4)
            else:
                note("expert combine [B, d]", "all-reduce",
                     size(mesh, split_axes(shards[lw + ("moe", "w_down")], 2)), rows * d * ACT)
            if lw + ("moe", "shared", "w_down") in shards:
                note("shared expert output [B, d]", "all-reduce",
                     size(mesh, split_axes(shards[lw + ("moe", "shared", "w_down")], 1)), rows * d * ACT)
        else:
            note("MLP output [B, d]", "all-reduce", size(mesh, split_axes(shards[lw + ("w_down",)], 1)), rows * d * ACT)
        for key in layer_ops:
            by_kind[key] = by_kind.get(key, 0) + 1
    for (what, op, g, nbytes), count in by_kind.items():
        add(what, op, g, nbytes, count)
    add("embedding lookup [B, d]", "all-reduce", size(mesh, split_axes(shards[("embed",)], 0)), rows * d * ACT)
    head = ("lm_head",) if ("lm_head",) in shards else ("embed",)
    add("LM head logits [B, V]", "all-gather", size(mesh, split_axes(shards[head], 0)), rows * cfg.vocab_size * ACT)
    return {"ops": ops, "count": sum(o["count"] for o in ops), "bytes": sum(o["bytes"] for o in ops)}


def analyse(name: str, family, source: str, hf: dict, layout: Layout) -> dict:
    cfg = family.Config.from_hf(hf)
    mesh = layout.mesh()
    row = {"model": name, "config": source, "layout": layout.name, "flags": layout.flags,
           "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)), "devices": math.prod(mesh.axis_sizes)}
    try:
        sharding.check_layout(cfg, family.cache_spec(cfg), mesh)
    except ValueError as err:
        return {**row, "refused": str(err)}
    return {**row, **figures(family, cfg, mesh)}


def figures(family, cfg, mesh, batches: tuple[int, ...] = (1, 8)) -> dict:
    """Per-device weight and cache bytes, the collectives of a decode step of each batch size,
    and what the layout replicates, for a model (family, cfg) over a mesh (an AbstractMesh or a
    real one)."""
    specs = family.weight_specs(cfg)
    tree = sharding.weight_shardings(abstract_weights(specs, jnp.bfloat16), specs, mesh)
    flat = dict(sorted_like(specs, tree))
    caches, cache_layers = cache_bytes(family, cfg, mesh)
    row = {"params": cfg.num_params(), "weights": weight_bytes(specs, flat), "cache": caches,
           "collectives": {f"batch_{b}": step_collectives(cfg, specs, flat, cache_layers, mesh, b) for b in batches}}
    tensor = size(mesh, sharding.mesh_axes(mesh, "q_heads"))
    replicated = {"MLA latent cache (over the tensor devices)" for x in cache_layers
                  if x["kind"] == "latent" and tensor > 1}
    replicated |= {"conv windows" for x in cache_layers if x["kind"] == "recurrent" and tensor > 1}
    for x in cache_layers:
        if x["kind"] == "kv" and x["kv_heads_local"] * tensor > x["kv_heads"]:
            replicated.add(f"KV heads ({x['kv_heads_local']} of {x['kv_heads']} per device, each on "
                           f"{x['kv_heads_local'] * tensor // x['kv_heads']} tensor devices)")
    row["replicated"] = sorted(replicated)
    return row


def sorted_like(specs: Any, tree: Any):
    """(path, sharding) pairs of a sharding tree in `iter_specs` order (jax flattens dicts by sorted key)."""
    for path, _ in iter_specs(specs):
        node = tree
        for key in path:
            node = node[key]
        yield path, node


def fmt_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= 2 ** 20:
        return f"{n / 2 ** 20:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n:.0f} B"


def markdown(rows: list[dict], date: str) -> str:
    lines = [f"# Parallel layouts from weld's sharding rules ({date})", "",
             "Computed by `benchmarks/sharding_layouts.py` from each family's `weight_specs` and `cache_spec`, "
             "`sharding.weight_shardings` / `cache_shardings` on a `jax.sharding.AbstractMesh` of each layout "
             "(the mesh `sharding.make_mesh` builds) and `sharding.check_layout`; the formulas and assumptions "
             "are in the script's docstring and below. Per device, per decode step.", "",
             "| model | layout (flags) | mesh | weights bf16 | weights int8 | of which experts (bf16) | "
             "KV/latent per token | recurrent per seq | collectives/step (B=1) | bytes sent (B=1) | bytes sent (B=8) "
             "| replicated |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mesh = " x ".join(f"{k}{v}" for k, v in r["mesh"].items())
        head = f"| {r['model']} | {r['layout']} (`{r['flags']}`) | {mesh} "
        if "refused" in r:
            lines.append(head + f"| refused: {r['refused']} |||||||||")
            continue
        w, c, c1, c8 = r["weights"], r["cache"], r["collectives"]["batch_1"], r["collectives"]["batch_8"]
        state = fmt_bytes(c["recurrent_per_sequence"]) if c["recurrent_per_sequence"] else "-"
        lines.append(head + f"| {fmt_bytes(w['bf16'])} | {fmt_bytes(w['int8'])} | {fmt_bytes(w['experts_bf16'])} "
                     f"| {fmt_bytes(c['kv_per_token'])} | {state} "
                     f"| {c1['count']} | {fmt_bytes(c1['bytes'])} | {fmt_bytes(c8['bytes'])} "
                     f"| {', '.join(r['replicated']) or '-'} |")
    lines += ["", "## Collectives of one decode step, by kind (batch 8)", "",
              "| model | layout | what | op | group | per step | bytes sent per device |",
              "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        if "refused" in r or r["devices"] == 1:
            continue
        for o in r["collectives"]["batch_8"]["ops"]:
            lines.append(f"| {r['model']} | {r['layout']} | {o['what']} | {o['op']} | {o['group']} | {o['count']} "
                         f"| {fmt_bytes(o['bytes'])} |")
    lines += ["", "## Models", ""]
    seen = set()
    for r in rows:
        if r["model"] in seen or "params" not in r:
            continue
        seen.add(r["model"])
        lines.append(f"- {r['model']}: `{r['config']}` config.json, {r['params'] / 1e9:.1f}B parameters as weld "
                     f"declares them ({fmt_bytes(r['weights']['whole_bf16'])} in bf16).")
    lines += ["", "## Formulas and assumptions", "", __doc__.split("Bytes:", 1)[1].strip(), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--date", default=str(datetime.date.today()))
    args = p.parse_args()
    rows = [analyse(name, family, source, hf, layout)
            for name, (family, source, hf) in MODELS.items() for layout in LAYOUTS]
    out = pathlib.Path(args.out_dir)
    stem = out / f"sharding_layouts_{args.date}"
    result = {"date": args.date, "jax": jax.__version__, "activation_bytes": ACT,
              "layouts": [dataclasses.asdict(x) for x in LAYOUTS], "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(rows, args.date))
    for r in rows:
        if "refused" in r:
            print(f"{r['model']:20s} {r['layout']:52s} refused")
        else:
            print(f"{r['model']:20s} {r['layout']:52s} {fmt_bytes(r['weights']['bf16']):>10s} "
                  f"{fmt_bytes(r['cache']['kv_per_token']):>10s}/tok  {r['collectives']['batch_1']['count']:4d} coll "
                  f"{fmt_bytes(r['collectives']['batch_8']['bytes']):>10s} (B=8)")
    print("wrote", stem.with_suffix(".md"), "and .json")


if __name__ == "__main__":
    main()
