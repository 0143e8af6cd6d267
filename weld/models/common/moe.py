"""Mixture-of-experts layers: routers and a dispatch that reads only the experts tokens chose.

Routers (`MoE.router`), as transformers implements them:
- "softmax_topk" (Qwen3-MoE, Mixtral): p = softmax(x Wᵀ) over all experts in f32, top-k of p,
  renormalised to sum 1 when norm_topk_prob;
- "topk_softmax" (gpt-oss): top-k of the logits x Wᵀ + b, softmax over the k selected;
- "sigmoid_group" (DeepSeek-V3, Kimi K2): s = sigmoid(x Wᵀ); selection on s + the score
  correction bias, restricted to the topk_group groups (of n_group) with the best sum of their
  two best biased scores; weights are the unbiased s of the chosen experts, renormalised (plus
  1e-20) when norm_topk_prob, times routed_scaling_factor;
- "softmax_group" (DeepSeek-V2): p = softmax(x Wᵀ); group score = the group's best p; top-k
  within the best topk_group groups (n_group 1: plain top-k); weights p, never renormalised,
  times routed_scaling_factor.

Dispatch (`experts`). Each (token, slot) pair goes to its expert; pairs are sorted by expert and
laid out in tiles of `tile` rows, each tile holding one expert's pairs (its group padded to
whole tiles), so that a loop over the tiles in use runs each tile's FFN with only that
expert's matrices [out, in], read from the stacked weights [experts, out, in] in place. At
small decode batches every pair is its own tile (tile 1): a step reads the chosen experts'
weights and nothing else, never the whole stack (a dense einsum over all experts would, and a
gather of the chosen matrices would copy them first). When many tokens share each expert
(prefill) the tiles widen (`MAX_TILE` rows): a grouped matmul whose padding is at most one tile
per expert. The result rows, scaled by their routing weights, are added back to their tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common import sharding
from weld.models.common.checkpoint import Convert, split_rows
from weld.models.common.layers import fuse_gate_up, gated_mlp, gated_mlp_specs, linear, prepare_matrices, unpacked
from weld.models.common.quant import QuantWeight, concat_rows
from weld.models.common.spec import WeightSpec

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group", "softmax_group")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
# Rows per tile. Tiles of 1 row read an expert once per token that chose it, with no padding:
# best at decode sizes even when tokens share experts (measured on the 2-core box, 64 experts,
# top-8, d 768, i 384, one layer: 16 tokens take 15.3 ms in 1-row tiles, 19.5 ms in 2-row ones).
# From WIDE_FROM pairs per expert on, tiles are that mean rounded up to a power of two, at most
# MAX_TILE rows: a grouped matmul that reads each expert once per tile (512 tokens: 137 ms in
# 8-row tiles, 113 in 16, 98 in 32, 106 in 64).
WIDE_FROM = 8
MAX_TILE = 32


@dataclasses.dataclass(frozen=True)
class MoE:
    """One family's MoE settings (hashable: part of its Config)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert (DeepSeek: moe_intermediate_size x n_shared_experts)
    shared_gate: bool = False  # Qwen3-Next: the shared expert's output scaled by sigmoid(x w_gateᵀ), w_gate [1, d]
    activation: str = "swiglu"
    expert_bias: bool = False  # gpt-oss: biases on the experts' projections
    router_bias: bool = False  # gpt-oss: a bias on the router's logits
    score_bias: bool = False  # DeepSeek-V3: e_score_correction_bias, for selection only
    swiglu_limit: float = 7.0  # clamped_swiglu
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        def check(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"invalid MoE config: {msg}")

        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        check(self.top_k <= self.num_experts, f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        check(self.router in ROUTERS, f"router {self.router!r} is not one of {ROUTERS}")
        check(self.activation in ACTIVATIONS, f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        check(self.num_experts % self.n_group == 0,
              f"num_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})")
        check(self.topk_group <= self.n_group, f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        if self.router == "sigmoid_group" and self.n_group > 1:
            per_group = self.num_experts // self.n_group
            check(per_group >= 2, f"sigmoid_group routing scores groups by their best two experts, but a group "
                                  f"has {per_group}")
            check(self.topk_group * per_group >= self.top_k,
                  f"topk_group ({self.topk_group}) groups of {per_group} hold fewer than top_k ({self.top_k}) experts")


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest of x [n, m] along its last axis and their indices int32, largest first, ties
    to the lower index (as `jax.lax.top_k`, except that -0.0 and 0.0 tie here), from k max
    reductions and masks: no sort, gather or
    scatter, so the TPU megakernel can trace it (Mosaic has no rule for `top_k`); k is small."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    values, indices = [], []
    for _ in range(k):
        best = jnp.max(x, axis=-1, keepdims=True)
        at = jnp.min(jnp.where(x == best, iota, x.shape[-1]), axis=-1, keepdims=True)
        values.append(best)
        indices.append(at)
        x = jnp.where(iota == at, -jnp.inf, x)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(indices, axis=-1)


def _pick(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [n, m] at idx [n, k] (take_along_axis, as masked sums: exact, and no gather)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.concatenate([jnp.sum(jnp.where(iota == idx[:, j:j + 1], x, 0.0), axis=-1, keepdims=True)
                            for j in range(idx.shape[-1])], axis=-1)


def route(moe: MoE, logits: jax.Array, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Routing weights f32 [n, k] and expert ids int32 [n, k] of router logits [n, E] (f32).
    bias: gpt-oss's router bias (added to the logits) or DeepSeek-V3's score correction bias.
    Written without sort, gather or scatter (`top_k`, `_pick`): the megakernel traces it too."""
    logits = logits.astype(jnp.float32)
    k = moe.top_k
    if moe.router == "softmax_topk":
        weights, idx = top_k(jax.nn.softmax(logits, axis=-1), k)
        if moe.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, idx.astype(jnp.int32)
    if moe.router == "topk_softmax":
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        top, idx = top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), idx.astype(jnp.int32)
    if moe.router == "sigmoid_group":
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
        if moe.n_group > 1:
            per_group = moe.num_experts // moe.n_group  # a group's best two: its max, then its max without it
            grouped = choice.reshape(choice.shape[:-1] + (moe.n_group, per_group))
            first = jnp.max(grouped, axis=-1, keepdims=True)
            iota = jax.lax.broadcasted_iota(jnp.int32, grouped.shape, grouped.ndim - 1)
            at = jnp.min(jnp.where(grouped == first, iota, per_group), axis=-1, keepdims=True)
            second = jnp.max(jnp.where(iota == at, -jnp.inf, grouped), axis=-1)
            group_score = first[..., 0] + second  # [n, groups]
            choice = _keep_groups(choice, group_score, moe, 0.0)
        _, idx = top_k(choice, k)
        weights = _pick(scores, idx)
        if moe.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * moe.routed_scaling_factor, idx.astype(jnp.int32)
    # softmax_group (DeepSeek-V2): greedy or group-limited greedy
    probs = jax.nn.softmax(logits, axis=-1)
    choice = probs
    if moe.n_group > 1:
        group_score = jnp.max(probs.reshape(probs.shape[:-1] + (moe.n_group, -1)), axis=-1)
        choice = _keep_groups(probs, group_score, moe, 0.0)
    weights, idx = top_k(choice, k)
    return weights * moe.routed_scaling_factor, idx.astype(jnp.int32)


def _keep_groups(scores: jax.Array, group_score: jax.Array, moe: MoE, fill: float) -> jax.Array:
    """scores [n, E] with every expert outside the topk_group best groups set to `fill`."""
    _, best = top_k(group_score, moe.topk_group)  # [n, topk_group]
    group_of = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1) // (moe.num_experts // moe.n_group)
    keep = functools.reduce(jnp.logical_or, [group_of == best[:, j:j + 1] for j in range(moe.topk_group)])
    return jnp.where(keep, scores, fill)


def expert_ffn(moe: MoE, x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, b_gate_up: jax.Array | None = None,
               b_down: jax.Array | None = None) -> jax.Array:
    """One expert's FFN on rows x [r, d]: w_gate_up [2 i, d] (gate rows then up rows), w_down [d, i]."""
    gate_up = linear(x, w_gate_up, b_gate_up)
    i = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :i], gate_up[..., i:]
    if moe.activation == "clamped_swiglu":  # gpt-oss
        gate = jnp.minimum(gate, moe.swiglu_limit)
        up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
        h = (up + 1) * (gate * jax.nn.sigmoid(moe.swiglu_alpha * gate))
    else:
        h = jax.nn.silu(gate) * up
    return linear(h, w_down, b_down)


def experts(moe: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array, lw: dict) -> jax.Array:
    """sum_k weights[n, k] * FFN_{idx[n, k]}(x[n]) for x [n, d]; lw holds the stacked experts:
    "w_gate_up" [E, 2 i, d] (or "w_gate" and "w_up" [E, i, d]), "w_down" [E, d, i], and with
    expert_bias "b_gate_up" [E, 2 i] (or "b_gate", "b_up") and "b_down" [E, d]. E is the
    stacks' (a device's own experts under expert parallelism), not necessarily moe's."""
    n, d = x.shape
    k = idx.shape[-1]
    pairs = n * k
    num_experts = np.shape(lw["w_down"])[0]
    per_expert = -(-pairs // num_experts)
    tile = 1 if per_expert < WIDE_FROM else min(MAX_TILE, 1 << (per_expert - 1).bit_length())
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # pairs sorted by expert
    expert_of = flat[order]
    if tile == 1:  # every pair its own tile, in expert order
        num_tiles, rows, tile_expert, used = pairs, order, expert_of, pairs
    else:
        sizes = jnp.bincount(flat, length=num_experts)
        padded = (sizes + tile - 1) // tile * tile  # each expert's group padded to whole tiles
        rank = jnp.arange(pairs) - (jnp.cumsum(sizes) - sizes)[expert_of]
        dest = (jnp.cumsum(padded) - padded)[expert_of] + rank  # row of each sorted pair
        num_tiles = -(-pairs // tile) + num_experts
        rows = jnp.full((num_tiles * tile,), -1, jnp.int32).at[dest].set(order)  # -1: padding
        tile_expert = jnp.zeros((num_tiles,), jnp.int32).at[dest // tile].set(expert_of)
        used = jnp.sum(padded) // tile
    token = jnp.maximum(rows, 0) // k
    xr = x[token]  # [num_tiles * tile, d]
    scale = jnp.where(rows >= 0, weights.reshape(-1)[jnp.maximum(rows, 0)], 0.0)
    gate_up = _stacked_gate_up(lw)
    bias = (_stacked_gate_up(lw, "b") if moe.expert_bias else None), lw.get("b_down")

    def body(j, out):
        e = tile_expert[j]
        pick = lambda w: None if w is None else jax.tree_util.tree_map(  # noqa: E731  (a QuantWeight stack too)
            lambda a: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False), w)
        xj = jax.lax.dynamic_slice_in_dim(xr, j * tile, tile, 0)
        yj = expert_ffn(moe, xj, pick(gate_up), pick(lw["w_down"]), pick(bias[0]), pick(bias[1]))
        return jax.lax.dynamic_update_slice_in_dim(out, yj.astype(out.dtype), j * tile, 0)

    out = jax.lax.fori_loop(0, used, body, jnp.zeros((num_tiles * tile, d), jnp.float32))
    out = out * scale[:, None]
    return jnp.zeros((n, d), jnp.float32).at[token].add(out).astype(x.dtype)


def _stacked_gate_up(lw: dict, prefix: str = "w") -> jax.Array | None:
    """The stacked [E, 2 i, ...] gate/up of an MoE layer, fused at load or (unfused) concatenated."""
    if f"{prefix}_gate_up" in lw:
        return lw[f"{prefix}_gate_up"]
    if f"{prefix}_gate" not in lw:
        return None
    gate, up = lw[f"{prefix}_gate"], lw[f"{prefix}_up"]
    if isinstance(gate, QuantWeight) or isinstance(up, QuantWeight):  # kept blocks of two types: rare, slow
        gate, up = unpacked(gate), unpacked(up)
    return jnp.concatenate([gate, up], axis=1)


EXPERT_MATRICES = ("w_gate_up", "w_gate", "w_up", "w_down")  # the stacks [E, out, in]


def fuse_experts(lw: dict) -> None:
    """Stacks an MoE layer's gate and up experts into one w_gate_up [E, 2 i, d] (and their biases),
    and fuses the shared expert's gate/up, in place: one matmul per tile instead of two."""
    if "w_gate" in lw:
        fused = concat_rows([lw["w_gate"], lw["w_up"]])  # [E, i, d] (or kept blocks) -> [E, 2 i, d]
        if fused is not None:  # kept blocks of two types stay apart
            del lw["w_gate"], lw["w_up"]
            lw["w_gate_up"] = fused
    if "b_gate" in lw:
        lw["b_gate_up"] = jnp.concatenate([lw.pop("b_gate"), lw.pop("b_up")], axis=1)
    if "shared" in lw:
        fuse_gate_up(lw["shared"])


def prepare_experts(lw: dict, target) -> None:
    """An MoE layer's shared expert in `layers.prepared_matrix`'s form for target, in place (the
    stacks stay as loaded: float, or quantized expert by expert at load)."""
    if "shared" in lw:
        prepare_matrices(lw["shared"], EXPERT_MATRICES, target)


# The logical axes of the stacked experts' arrays (their `moe_specs`, and the fused forms).
STACK_AXES = {"w_gate": ("experts", "expert_mlp", "embed"), "w_up": ("experts", "expert_mlp", "embed"),
              "w_down": ("experts", "embed", "expert_mlp"), "w_gate_up": ("experts", None, "embed"),
              "b_gate": ("experts", "expert_mlp"), "b_up": ("experts", "expert_mlp"), "b_gate_up": ("experts", None),
              "b_down": ("experts", "embed")}


def routed_experts(moe: MoE, x: jax.Array, weights: jax.Array, idx: jax.Array, lw: dict) -> jax.Array:
    """`experts`, or, with the experts or their FFNs split over the active mesh, the same in
    `shard_map`: each device runs its own experts (expert parallelism: the mesh has an "ep"
    axis) on its slice of each expert's FFN, for the pairs routed to them, then one sum over the
    devices combines them; no expert weight leaves its device. Pairs routed elsewhere weigh 0 on
    a device (they still fill its tiles: simple, and costs compute, not weight bytes). Without
    experts over dp, each data-parallel rank does this for its own rows only."""
    mesh = sharding.active_mesh()
    if mesh is None:
        return experts(moe, x, weights, idx, lw)
    stacks = {key: lw[key] for key in STACK_AXES if key in lw}
    specs = {key: sharding.partition(mesh, STACK_AXES[key], np.shape(a)) for key, a in stacks.items()}
    named = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)  # noqa: E731
    ex = next((named(spec[0]) for spec in specs.values() if spec[0] is not None), ())
    inner = tuple(dict.fromkeys(a for spec in specs.values() for entry in spec[1:] for a in named(entry)))
    if not ex and not inner:  # nothing split: every device runs every expert whole
        return experts(moe, x, weights, idx, lw)
    local = moe.num_experts // (sharding.axis_size(mesh, ex) if ex else 1)

    def body(x, weights, idx, stacks):
        first = jax.lax.axis_index(ex) * local if ex else 0
        mine = (idx >= first) & (idx < first + local)
        if inner and "b_down" in stacks:  # a bias is added once, not once per FFN slice
            stacks = dict(stacks, b_down=stacks["b_down"] * (jax.lax.axis_index(inner) == 0))
        y = experts(moe, x, jnp.where(mine, weights, 0), jnp.where(mine, idx - first, 0), stacks)
        return jax.lax.psum(y.astype(jnp.float32), ex + inner).astype(x.dtype)

    # Data-parallel ranks holding the same experts each run their own rows; experts spread over
    # dp (expert parallelism) need every row on every device.
    rows = sharding.mesh_axes(mesh, "batch")
    if rows and not set(rows) & set(ex + inner) and x.shape[0] % sharding.axis_size(mesh, rows) == 0:
        own = sharding.spec_of(rows)
    else:
        own = sharding.P()
    return jax.shard_map(body, mesh=mesh, in_specs=(own, own, own, specs), out_specs=own,
                         check_vma=False)(x, weights, idx, stacks)


def moe_block(moe: MoE, lw: dict, x: jax.Array) -> jax.Array:
    """The routed experts (and the shared expert, if any) of normed input x [n, d]. lw: "router"
    [E, d] (+ "router_bias" / "score_bias" [E]), the stacked experts, and "shared" {w_gate,
    w_up, w_down} (or its fused "w_gate_up")."""
    logits = jnp.dot(x.astype(jnp.float32), lw["router"].astype(jnp.float32).T)  # the router in f32
    weights, idx = route(moe, logits, lw.get("router_bias", lw.get("score_bias")))
    y = routed_experts(moe, x, weights, idx, lw)
    if moe.shared_intermediate_size:
        shared = gated_mlp(lw["shared"], x)
        if moe.shared_gate:
            shared = shared * jax.nn.sigmoid(linear(x, lw["shared_gate"]).astype(jnp.float32)).astype(shared.dtype)
        y = y + shared
    return y


# ----- declaration and checkpoint names -----

def moe_specs(moe: MoE, d: int) -> dict:
    """An MoE layer's router and stacked experts [E, out, in] (what `moe_block` reads)."""
    n, i = moe.num_experts, moe.intermediate_size
    spec = {
        "router": WeightSpec((n, d), ("experts", "embed")),
        "w_gate": WeightSpec((n, i, d), ("experts", "expert_mlp", "embed"), quantize="expert"),
        "w_up": WeightSpec((n, i, d), ("experts", "expert_mlp", "embed"), quantize="expert"),
        "w_down": WeightSpec((n, d, i), ("experts", "embed", "expert_mlp"), quantize="expert"),
    }
    if moe.router_bias:
        spec["router_bias"] = WeightSpec((n,), ("experts",), init="zeros")
    if moe.score_bias:
        spec["score_bias"] = WeightSpec((n,), ("experts",), init="zeros")
    if moe.expert_bias:
        spec.update(b_gate=WeightSpec((n, i), ("experts", "expert_mlp"), init="zeros"),
                    b_up=WeightSpec((n, i), ("experts", "expert_mlp"), init="zeros"),
                    b_down=WeightSpec((n, d), ("experts", "embed"), init="zeros"))
    if moe.shared_intermediate_size:
        spec["shared"] = gated_mlp_specs(d, moe.shared_intermediate_size)
    if moe.shared_gate:
        spec["shared_gate"] = WeightSpec((1, d), (None, "embed"))
    return spec


def hf_moe_keys(prefix: str, path: tuple) -> dict:
    """transformers' names of an MoE block under `prefix` (e.g. "model.layers.{i}.mlp."): the
    router `gate`, experts one by one (`experts.{e}.gate_proj` ...) or stacked as transformers 5
    holds them in memory (`experts.gate_up_proj` [E, 2 i, d], gate rows then up rows;
    `experts.down_proj` [E, d, i]), DeepSeek's `shared_experts` and score correction bias, and
    Qwen3-Next's `shared_expert` with its `shared_expert_gate`."""
    keys = {
        prefix + "gate.weight": path + ("router",),
        prefix + "shared_expert_gate.weight": path + ("shared_gate",),
        prefix + "gate.e_score_correction_bias": path + ("score_bias",),
        prefix + "experts.gate_up_proj": Convert(split_rows(1, 1), path + ("w_gate",), path + ("w_up",)),
        prefix + "experts.down_proj": path + ("w_down",),
    }
    for hf, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
        keys[prefix + f"experts.{{e}}.{hf}.weight"] = path + (ours,)
        keys[prefix + f"shared_experts.{hf}.weight"] = path + ("shared", ours)
        keys[prefix + f"shared_expert.{hf}.weight"] = path + ("shared", ours)
    return keys


def gguf_moe_keys(blk: str, path: tuple) -> dict:
    """llama.cpp's names of an MoE block (`blk` e.g. "blk.{i}."): router, stacked experts,
    shared experts and DeepSeek-V3's score correction bias."""
    keys = {blk + "ffn_gate_inp.weight": path + ("router",), blk + "exp_probs_b.bias": path + ("score_bias",),
            blk + "ffn_gate_inp_shexp.weight": path + ("shared_gate",)}
    for name, ours in (("gate", "w_gate"), ("up", "w_up"), ("down", "w_down")):
        keys[blk + f"ffn_{name}_exps.weight"] = path + (ours,)
        keys[blk + f"ffn_{name}_shexp.weight"] = path + ("shared", ours)
    return keys
