"""The model families on the TPU decode megakernel: llama (dense and MoE, sliding windows
included), gemma3 (sandwich norms, sliding and full layers with their own RoPE bases), gpt_oss
(attention sinks, sliding and full layers, routed experts with biases and the clamped SwiGLU), deepseek
(MLA + MoE), and the hybrids with linear-attention layers, qwen3_next (Gated DeltaNet + gated GQA
with partial RoPE and (1 + w) norms, MoE) and kimi_linear (KDA + NoPE MLA, MoE).

The kernel (`weld.kernels.megakernel.decode`) knows plain numbers and arrays; this adapter maps a
family's `Config` to its `MegakernelSpec`, the family's weight tree to the kernel's operands
(the per-layer matrices themselves, in stream order: no copy), and offers `forward` with the
family's contract for calls of a few tokens per row (decode: 1; a verify block: k + 1), so the
engine's fused decode loop runs it in place of the family's `forward`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from weld.kernels.megakernel.decode import EXPERT_BIASES, MATRICES, Int4Matrix, Int8Matrix, decode_step
from weld.kernels.megakernel.plan import MegakernelSpec
from weld.models import deepseek, gemma3, gpt_oss, kimi_linear, llama, qwen3_next
from weld.models.common import linear_attention as la
from weld.models.common import moe as moe_lib
from weld.models.common.cache import AttentionBatch, Cache, KVPages, LatentPages, RecurrentState
from weld.models.common.quant import QuantWeight

FAMILIES = (llama.Config, gemma3.Config, gpt_oss.Config, deepseek.Config, qwen3_next.Config, kimi_linear.Config)
NORM_PLUS_ONE = (qwen3_next.Config, gemma3.Config)  # families whose RMSNorm weights are (1 + w), stored around 0
LINEAR = "linear_attention"  # a hybrid's layer type for its linear-attention layers
# the kernel's matrix names -> the family's weight names (a sparse layer's under lw["moe"]: the
# expert stacks under the same names, the shared expert's under "shared"); a linear layer's
# matrices have the family's own names
_WEIGHT_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down",
                 "q_a": "wq_a", "q_b": "wq_b", "kv_a": "wkv_a", "w_uk": "w_uk", "w_uv": "w_uv"}
LINEAR_MATRICES = (*la.INPUT_NAMES, "w_fb", "w_gb", "w_out")  # a linear layer's, under the family's names
_SHARED_NAMES = {"shared_gate": "w_gate", "shared_up": "w_up", "shared_down": "w_down"}
KV_WEIGHTS = ("wk", "wv", "bk", "bv")  # whole on every tensor-parallel device when KV heads are fewer


def _mla(cfg):
    return getattr(cfg, "mla", None)


def _linear_layers(cfg) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(getattr(cfg, "layer_types", None) or ()) if kind == LINEAR) \
        if hasattr(cfg, "linear") else ()


def check_supported(cfg) -> None:
    """Raises ValueError for what the megakernel does not cover."""
    if not isinstance(cfg, FAMILIES):
        raise ValueError(f"the megakernel runs the llama, gemma3, gpt_oss, deepseek, qwen3_next and kimi_linear "
                         f"families, got a {type(cfg).__module__} config")
    moe = cfg.moe
    if moe is not None and moe.activation not in ("swiglu", "clamped_swiglu"):
        raise ValueError(f"the megakernel's experts are SwiGLU or gpt-oss's clamped SwiGLU ({cfg.architecture} has "
                         f"activation {moe.activation!r}); use backend='xla'")


def _ropes(cfg) -> list:
    """Each layer's rotary embedding (None: none)."""
    mla = _mla(cfg)
    if mla:
        return [mla.rope] * cfg.num_layers
    if hasattr(cfg, "rope_for"):
        return [cfg.rope_for(i) for i in range(cfg.num_layers)]
    return [cfg.rope] * cfg.num_layers


def _rope_tables(cfg) -> tuple[list, tuple[int, ...]]:
    """(the distinct rotary embeddings, in order of first use; each layer's index among them)."""
    ropes = _ropes(cfg)
    distinct = [r for i, r in enumerate(ropes) if r is not None and r not in ropes[:i]]
    return distinct, tuple(distinct.index(r) if r is not None else 0 for r in ropes)


def _pages(cfg) -> dict:
    """The spec's sliding windows and page groups (`cache_spec(cfg).page_groups`), per layer."""
    from weld.models import FAMILIES as ALL

    cache = next(f for f in ALL if isinstance(cfg, f.Config)).cache_spec(cfg)
    groups = cache.page_groups()
    if len(groups) == 1 and groups[0].window is None:
        return {}
    paged = {i for g in groups for i in g.layers}
    return dict(layer_windows=tuple(cache.layers[i].window or 0 if i in paged else 0 for i in range(cfg.num_layers)),
                layer_groups=tuple(cache.group_of(i) if i in paged else 0 for i in range(cfg.num_layers)),
                page_groups=len(groups))


def _gemma(cfg, weight_dtype) -> dict:
    """Gemma 3's switches: sandwich norms, the GELU-tanh MLP, the embedding scaled by sqrt(d) in
    the weights' dtype (as the XLA forward and transformers scale it), the logits' soft cap."""
    if not isinstance(cfg, gemma3.Config):
        return {}
    return dict(sandwich_norms=True, mlp_activation="gelu_tanh",
                embed_scale=float(np.asarray(math.sqrt(cfg.hidden_size), jnp.dtype(weight_dtype))),
                logit_softcap=float(cfg.final_logit_softcapping or 0.0))


def spec_for(cfg, *, batch: int, tokens_per_row: int = 1, page_size: int, weight_dtype, kv_dtype,
             pages_per_kv_tile: int = 8, kv_ring_depth: int = 2, int8: bool = False, float_matrices: tuple[str, ...] = (),
             float_dtype=jnp.float32, int4_experts: bool = False, expert_shards: int = 1,
             kv_pool_heads: int = 0, moe_ranks: int = 1) -> MegakernelSpec:
    """The kernel's spec for `cfg` at this batch shape (`float_matrices`: those that stay
    float_dtype in an int8 model; `kv_pool_heads`: a tensor-parallel device's pools hold that
    many KV heads whole, cfg's being the ones it attends with; `expert_shards`: expert
    parallelism, this device holding
    1/expert_shards of cfg's routed experts)."""
    check_supported(cfg)
    mla = _mla(cfg)
    ropes, layer_rope = _rope_tables(cfg)
    rope = ropes[0] if ropes else None
    moe = cfg.moe
    experts = {} if moe is None or not cfg.sparse_layers else dict(
        sparse_layers=tuple(cfg.sparse_layers), num_experts=moe.num_experts // expert_shards,
        expert_shards=expert_shards, moe_ranks=moe_ranks, top_k=moe.top_k,
        expert_intermediate=moe.intermediate_size, shared_intermediate=moe.shared_intermediate_size,
        shared_expert_gate=moe.shared_gate, router_bias=moe.router_bias or moe.score_bias,
        expert_bias=moe.expert_bias, expert_activation=moe.activation, swiglu_limit=float(moe.swiglu_limit),
        swiglu_alpha=float(moe.swiglu_alpha))
    if mla:  # one latent key head of kv_lora_rank + rope_dim
        attention = dict(num_heads=mla.num_heads, num_kv_heads=1, head_dim=mla.kv_lora_rank + mla.rope_dim,
                         attention="mla", q_lora_rank=mla.q_lora_rank or 0, kv_lora_rank=mla.kv_lora_rank,
                         nope_dim=mla.nope_dim, rope_dim=mla.rope_dim, v_dim=mla.v_dim,
                         rope_interleaved=mla.rope is not None and mla.rope.interleaved, attn_scale=float(mla.scale),
                         rope=mla.rope is not None)
    else:
        g = cfg.attention
        attention = dict(num_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                         qkv_bias=g.qkv_bias, o_bias=g.o_bias, qk_norm=g.qk_norm, output_gate=g.output_gate,
                         attention_sinks=g.sinks, kv_pool_heads=kv_pool_heads,
                         rotary_dim=rope.dim if rope.dim < g.head_dim else 0, attn_scale=float(g.scale or 0.0))
    linear_layers = _linear_layers(cfg)
    linear = {} if not linear_layers else dict(
        linear_layers=linear_layers, linear_kind=cfg.linear.kind, linear_k_heads=cfg.linear.num_k_heads,
        linear_v_heads=cfg.linear.num_v_heads, linear_k_dim=cfg.linear.k_dim, linear_v_dim=cfg.linear.v_dim,
        conv_width=cfg.linear.conv_width, linear_norm_eps=cfg.linear.norm_eps,
        gate_lower_bound=float(cfg.linear.gate_lower_bound or 0.0), tiled_v_heads=cfg.linear.tiled_sharing)
    return MegakernelSpec(
        hidden=cfg.hidden_size, intermediate=max(getattr(cfg, "intermediate_size", 0), 1), vocab=cfg.vocab_size,
        num_layers=cfg.num_layers, weight_bytes=1 if int8 else jnp.dtype(weight_dtype).itemsize,
        kv_bytes=jnp.dtype(kv_dtype).itemsize, batch=batch, tokens_per_row=tokens_per_row, page_size=page_size,
        pages_per_kv_tile=pages_per_kv_tile, kv_ring_depth=kv_ring_depth, scale_bytes=4 if int8 else 0, float_matrices=tuple(float_matrices),
        float_bytes=jnp.dtype(float_dtype).itemsize, int4_experts=int4_experts, rms_norm_eps=cfg.rms_norm_eps,
        rope_mscale=tuple(float(r.tables()[1]) for r in ropes), rope_tables=max(len(ropes), 1), layer_rope=layer_rope if len(ropes) > 1 else (),
        **attention, **experts, **linear, **_pages(cfg), **_gemma(cfg, weight_dtype))


def kernel_params(cfg, weights: dict) -> dict:
    """The kernel's params from the family's weight tree. The matrices are the tree's own arrays:
    float, or int8 per output channel as quantized at load (`quant.QuantWeight`, "int8_channel");
    only the small vectors are stacked per call (zeros for layers without them; (1 + w) norms as
    1 + w). A tied embedding quantized as the LM head is looked up in `prepare_weights`' float
    copy ("embed_table")."""
    layers = weights["layers"]
    mla = _mla(cfg)
    plus = 1.0 if isinstance(cfg, NORM_PLUS_ONE) else 0.0

    def stack(key, width, pick=lambda lw, key: lw.get(key)):
        """A per-layer vector [L, width] in f32: zeros where a layer has none (as wide as the
        layers' own: a device's shard of an expert-parallel bias)."""
        rows = [pick(lw, key) for lw in layers]
        width = next((r.size for r in rows if r is not None), width)
        return jnp.stack([jnp.zeros((width,), jnp.float32) if r is None else r.reshape(-1).astype(jnp.float32)
                          for r in rows])

    d = cfg.hidden_size
    params = {
        "embed": weights.get("embed_table", weights["embed"]),
        "lm_head": _matrix(weights.get("lm_head", weights["embed"])),
        "layers": [_layer_params(lw, mla is not None) for lw in layers],
        "attn_norm": stack("attn_norm", d) + plus,
        "mlp_norm": stack("mlp_norm", d) + plus,
        "final_norm": weights["final_norm"].astype(jnp.float32) + plus,
    }
    ropes, _ = _rope_tables(cfg)
    if ropes:
        params["inv_freq"] = jnp.asarray(np.stack([np.asarray(r.tables()[0]) for r in ropes]), jnp.float32)
    if isinstance(cfg, gemma3.Config):  # sandwich norms
        params["post_attn_norm"] = stack("post_attn_norm", d) + plus
        params["post_mlp_norm"] = stack("post_mlp_norm", d) + plus
    if mla:
        params["kv_a_norm"] = stack("kv_a_norm", mla.kv_lora_rank)
        if mla.q_lora_rank:
            params["q_a_norm"] = stack("q_a_norm", mla.q_lora_rank)
    else:
        g = cfg.attention
        if g.qkv_bias:
            params["qkv_bias"] = stack("bq", g.q_width + 2 * g.num_kv_heads * g.head_dim,
                                       lambda lw, _: jnp.concatenate([lw["bq"], lw["bk"], lw["bv"]]) if "bq" in lw else None)
        if g.o_bias:
            params["o_bias"] = stack("bo", d)
        if g.sinks:
            params["sinks"] = stack("sinks", g.num_heads)
        if g.qk_norm:
            params["q_norm"] = stack("q_norm", g.head_dim) + plus
            params["k_norm"] = stack("k_norm", g.head_dim) + plus
    net = getattr(cfg, "linear", None)
    if _linear_layers(cfg):
        params["A_log"] = stack("A_log", net.num_v_heads)
        params["dt_bias"] = stack("dt_bias", net.value_dim if net.kind == "kda" else net.num_v_heads)
        params["linear_norm"] = stack("norm", net.v_dim)
    moe = cfg.moe
    if moe is not None and cfg.sparse_layers:  # per-layer vectors of the sparse layers (zeros elsewhere)
        in_moe = lambda lw, key: lw["moe"].get(key) if "moe" in lw else None  # noqa: E731
        if moe.router_bias or moe.score_bias:
            params["router_bias"] = stack("router_bias" if moe.router_bias else "score_bias", moe.num_experts, in_moe)
        if moe.shared_gate:
            params["shared_expert_gate"] = stack("shared_gate", d, in_moe)
    return params


def _layer_params(lw: dict, mla: bool) -> dict:
    """One layer's matrices under the kernel's names: a sparse layer's expert stacks, router
    and shared expert from lw["moe"]; MLA's W_UK / W_UV [heads, dims, latent] as [heads x dims,
    latent] (a reshape: the same bytes); a linear layer's under its own names, and its conv."""
    if "w_out" in lw:  # a linear-attention layer
        out = {name: _matrix(lw[name]) for name in LINEAR_MATRICES if name in lw}
        out["conv"] = lw["conv"]
    else:
        names = [n for n in ("q", "q_a", "q_b", "kv_a", "w_uk", "w_uv", "o") if _WEIGHT_NAMES[n] in lw] if mla \
            else MATRICES[:4]
        out = {name: _matrix(lw[_WEIGHT_NAMES[name]]) for name in names}
        for name in ("w_uk", "w_uv"):
            if name in out:
                out[name] = _heads_as_rows(out[name])
    mlp = lw.get("moe", lw)
    out.update({name: _matrix(mlp[_WEIGHT_NAMES[name]]) for name in MATRICES[4:]})
    if "moe" in lw:
        out["router"] = mlp["router"]
        out.update({name: mlp[name] for name in EXPERT_BIASES if name in mlp})
        out.update({name: _matrix(mlp["shared"][key]) for name, key in _SHARED_NAMES.items() if "shared" in mlp})
    return out


def _heads_as_rows(w):
    """[heads, dims, latent] as [heads x dims, latent] (a reshape: the same bytes)."""
    if isinstance(w, Int8Matrix):
        return Int8Matrix(w.q.reshape(-1, w.q.shape[-1]), w.scale.reshape(-1))
    return w.reshape(-1, w.shape[-1])


def float_matrices(params: dict) -> tuple[str, ...]:
    """The kernel's names of the matrices that stay float in a model quantized to int8 (what the
    family's declaration leaves unquantized: MLA's W_UK / W_UV, linear attention's small
    projections); () when nothing is int8."""
    if not isinstance(params["lm_head"], Int8Matrix):
        return ()
    return tuple(sorted({name for lw in params["layers"] for name, w in lw.items()
                         if name not in ("router", "conv") and not isinstance(w, (Int8Matrix, Int4Matrix))}))


def int4_experts(params: dict) -> bool:
    """The routed experts are int4 per group (`quant` "int4_g128_rows")."""
    return any(isinstance(lw.get("down"), Int4Matrix) for lw in params["layers"])


def router(cfg):
    """The kernel's `route` for cfg: the family's own routing rule (`moe.route`)."""
    if cfg.moe is None:
        return None
    return lambda scores, bias: moe_lib.route(cfg.moe, scores, None if bias is None else bias[0])


def _matrix(w):
    """A float matrix as it is; a QuantWeight as the kernel's `Int8Matrix` or `Int4Matrix` of its
    own arrays (an expert stack's carry the leading axis)."""
    if not isinstance(w, QuantWeight):
        return w
    if w.fmt == "int8_channel":
        return Int8Matrix(w.codes, w.scales)
    if w.fmt == "int4_g128_rows":
        return Int4Matrix(w.codes, w.scales, w.mins, w.k)
    raise ValueError(f"the megakernel streams float, int8 per-channel or int4 g128 row matrices, not {w.fmt} "
                     "blocks: load with quantization 'int8_channel', 'int8_channel_int4_experts' or 'none'")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the kernel is tiled and run (hashable: a static argument under jit)."""

    tile_rows: int = 256
    vocab_tile_rows: int = 256
    ring_depth: int = 4
    # the attention's KV tiles (`attention.attend_rows`): 16 pages of 16 tokens, double buffered
    # (TPU v5e, benchmarks/attention_tpu.py: at 2,048 tokens 12-24% faster than 8 pages, and a
    # third buffer gained nothing)
    pages_per_kv_tile: int = 16
    kv_ring_depth: int = 2
    generation: str | None = None  # None: detected on a TPU, unchecked in interpret mode
    interpret: object = None  # None: interpret mode (default InterpretParams) unless on a TPU


def local_config(cfg, tensor: int, expert_shards: int = 1, expert_ranks: int = 1):
    """cfg as one of `tensor` tensor-parallel devices sees it (the shapes `sharding.weight_shardings`
    gives a device): its attention heads (GQA: and KV heads; MLA: the query heads, the latent and
    its rotary key stay whole, computed alike on every device; KV heads fewer than the devices
    whole on every device, each attending with one: `kv_pool_heads`), its linear-attention key and
    value heads (the q/k/v channels grouped per device: `tensor_parallel_config`), its slice of
    every MLP's intermediate and of the vocabulary, and of each routed expert's intermediate
    (split over tensor / expert_shards devices: expert parallelism puts 1/expert_shards of the
    experts on each group of them; x `expert_ranks` when the experts are split over the
    data-parallel ranks too). The experts stay counted whole: the router chooses among all of
    them (`spec_for(expert_shards=)` takes the device's share)."""
    if tensor == 1 and expert_ranks == 1:
        return cfg
    check_supported(cfg)
    mla, net = _mla(cfg), getattr(cfg, "linear", None) if _linear_layers(cfg) else None
    expert_tp = tensor // expert_shards
    whole_kv = not mla and cfg.num_kv_heads < tensor  # every device holds them all, attends with one
    split = {"num_heads": (mla.num_heads, tensor)} if mla else {"num_heads": (cfg.num_heads, tensor)}
    if not mla and not whole_kv:
        split["num_kv_heads"] = (cfg.num_kv_heads, tensor)
    if net is not None:
        split.update(linear_key_heads=(net.num_k_heads, tensor), linear_value_heads=(net.num_v_heads, tensor))
    split["vocab_size"] = (cfg.vocab_size, tensor)
    dense = len(getattr(cfg, "sparse_layers", ())) < cfg.num_layers  # the dense MLP's intermediate: split where used
    if dense:
        split["intermediate_size"] = (cfg.intermediate_size, tensor)
    if cfg.moe is not None:
        split.update(num_experts=(cfg.moe.num_experts, expert_shards * expert_ranks),
                     expert_intermediate=(cfg.moe.intermediate_size, expert_tp),
                     shared_intermediate=(cfg.moe.shared_intermediate_size, tensor))
    bad = [f"{name} {n} over {k} devices" for name, (n, k) in split.items() if n % k]
    if whole_kv and tensor % cfg.num_kv_heads:
        bad.append(f"{cfg.num_kv_heads} KV heads (whole on every device) into {tensor} devices")
    if bad:
        raise ValueError(f"the tensor-parallel megakernel splits heads, KV heads, intermediates, experts and the "
                         f"vocabulary evenly; this model's do not split: {', '.join(bad)}")
    moe = cfg.moe and dataclasses.replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // expert_tp,
                                          shared_intermediate_size=cfg.moe.shared_intermediate_size // tensor)
    local = dict(vocab_size=cfg.vocab_size // tensor, moe=moe)
    if dense:
        local["intermediate_size"] = cfg.intermediate_size // tensor
    if net is not None:
        local["linear"] = dataclasses.replace(net, num_k_heads=net.num_k_heads // tensor,
                                              num_v_heads=net.num_v_heads // tensor, shards=1,
                                              tiled_v_heads=False)  # regrouped (`la.value_head_order`)
    if mla:
        local["mla"] = dataclasses.replace(mla, num_heads=mla.num_heads // tensor)
    else:
        local.update(num_heads=cfg.num_heads // tensor, num_kv_heads=1 if whole_kv else cfg.num_kv_heads // tensor)
    return dataclasses.replace(cfg, **local)


def tensor_parallel_config(cfg, mesh):
    """cfg as the engine runs it with the megakernel over mesh: a linear-attention model's q/k/v
    channels grouped per tensor-parallel device (`DeltaNet.shards`; the weights are laid out so
    by `prepare_weights`, and the XLA forward reads them so too). Other configs are unchanged."""
    net = getattr(cfg, "linear", None)
    if not _linear_layers(cfg) or mesh is None:
        return cfg
    return dataclasses.replace(cfg, linear=dataclasses.replace(net, shards=tensor_layout(mesh)[1]))


def tensor_layout(mesh) -> tuple[str | tuple[str, ...] | None, int, int]:
    """(the tensor-parallel mesh axis or axes (None: none), their devices, the expert shards) of
    a ("dp", "tp") or ("dp", "ep", "tp") mesh (ValueError for others)."""
    from weld.models.common import sharding

    shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if set(mesh.axis_names) - {"dp", "ep", "tp"}:
        raise ValueError(f"the megakernel runs on a ('dp', 'tp') or ('dp', 'ep', 'tp') mesh, got {shape}")
    names = tuple(a for a in sharding.TENSOR if shape.get(a, 1) > 1)  # shard-major, as the rules split
    axis = None if not names else names[0] if len(names) == 1 else names
    return axis, math.prod(shape[a] for a in names), shape.get("ep", 1)


def check_mesh(cfg, mesh) -> None:
    """Raises ValueError when the megakernel cannot run cfg over mesh (before anything loads):
    shards that do not divide (`local_config`)."""
    _, tensor, shards = tensor_layout(mesh)
    local_config(cfg, tensor, shards, expert_ranks(cfg, mesh))


def expert_ranks(cfg, mesh) -> int:
    """The data-parallel ranks the routed experts are split over as well (`sharding.RULES`:
    experts over ("dp", "ep") under expert parallelism), 1 when they are not."""
    from weld.models.common import sharding

    if getattr(cfg, "moe", None) is None or "dp" not in sharding.mesh_axes(mesh, "experts"):
        return 1
    return sharding.data_parallel_size(mesh)


def sharded_forward(weights: dict, cfg, tokens, positions, cache: Cache, batch: AttentionBatch, logits_indices=None,
                    capture_layers: tuple[int, ...] = (), *, mesh, options: KernelOptions = KernelOptions()):
    """`forward` over mesh (a `Mesh`, or the abstract mesh the engine traces under): a ("dp",
    "tp") mesh, or with expert parallelism ("dp", "ep", "tp") (`sharding.RULES`: heads, MLPs and
    the vocabulary over ep x tp, routed experts over ep, each expert's FFN over tp). Each device
    runs the megakernel on its shard of the weights and pools (laid out by the sharding rules,
    `sharding.weight_shardings` / `cache_shardings`, so nothing moves on the way in),
    all-reducing inside the kernel by remote DMA over its tensor-parallel group (the experts'
    outputs too: the combine). Data-parallel ranks each run their own rows over their own pages
    (`weld.engine.batch.rank_rows`, local page ids) and their own block of the recurrent-state
    slots (`sharding.local_slots`). The
    logits come back split over the vocabulary, the hidden states whole (every device of a
    group holds the summed residual stream)."""
    from weld.models import FAMILIES
    from weld.models.common import sharding

    check_mesh(cfg, mesh)
    axis, tensor, shards = tensor_layout(mesh)
    moe_ranks = expert_ranks(cfg, mesh)
    net = getattr(cfg, "linear", None)
    if _linear_layers(cfg) and tensor > 1 and net.shards != tensor:
        raise ValueError(f"the linear layers' q/k/v channels are in {net.shards} groups, not one per each of the "
                         f"{tensor} tensor-parallel devices: run cfg through `tensor_parallel_config` before "
                         "`prepare_weights`")
    local = local_config(cfg, tensor, shards, moe_ranks)
    family = next(f for f in FAMILIES if isinstance(cfg, f.Config))
    weight_specs = jax.tree_util.tree_map(lambda s: s.spec, sharding.weight_shardings(weights, family.weight_specs(cfg),
                                                                                      mesh))
    kv_pool_heads = 0
    if not _mla(cfg) and cfg.num_kv_heads < tensor:  # KV heads fewer than the devices: every device
        # projects them all (its k / v weights whole: gathered here, in the step's program, from
        # the layout that splits their rows) into whole pools (`sharding.kv_pool_axes`)
        kv_pool_heads = cfg.num_kv_heads
        whole = jax.sharding.PartitionSpec()
        weight_specs = jax.tree_util.tree_map_with_path(
            lambda path, s: whole if any(getattr(k, "key", None) in KV_WEIGHTS for k in path) else s, weight_specs)
    cache_specs = jax.tree_util.tree_map(lambda s: s.spec, sharding.cache_shardings(cache, mesh))
    ranks = "dp" if sharding.data_parallel_size(mesh) > 1 else None  # each rank its own rows
    rows = jax.sharding.PartitionSpec(ranks)
    slots = jnp.arange(tokens.shape[0], dtype=jnp.int32) if batch.state_slots is None else batch.state_slots
    pool_slots = next((x.state.shape[0] for x in cache.layers if isinstance(x, RecurrentState)), 0)

    def step(w, t, p, c, bt, s):
        s = sharding.local_slots(s, pool_slots, mesh)  # each rank's block of the state pools
        logits, hidden, c = forward(w, local, t, p, c, AttentionBatch(bt, s), None, capture_layers, options=options,
                                    tp=(axis, tensor), expert_shards=shards, kv_pool_heads=kv_pool_heads,
                                    moe_ranks=moe_ranks)
        return (logits, c) if hidden is None else (logits, c, hidden)

    out_specs = (jax.sharding.PartitionSpec(ranks, None, axis), cache_specs) + ((rows,) if capture_layers else ())
    run = jax.shard_map(step, mesh=mesh, in_specs=(weight_specs, rows, rows, cache_specs, rows, rows),
                        out_specs=out_specs, check_vma=False)
    logits, cache, *hidden = run(weights, tokens, positions, cache, batch.block_tables, slots)
    if logits_indices is not None:
        logits = jnp.take_along_axis(logits, logits_indices[:, :, None], axis=1)
    return logits, (hidden[0] if hidden else None), cache


def forward(weights: dict, cfg, tokens, positions, cache: Cache, batch: AttentionBatch, logits_indices=None,
            capture_layers: tuple[int, ...] = (), *, options: KernelOptions = KernelOptions(),
            tp: tuple[str | tuple[str, ...], int] = (None, 1), expert_shards: int = 1, kv_pool_heads: int = 0,
            moe_ranks: int = 1):
    """The family's forward contract for one group of rows with few tokens each, on the megakernel
    (K/V pages, or latent pages, for the attention layers; a recurrent-state slot per row,
    `batch.state_slots`, for the linear ones).

    tokens, positions: int32 [b, t] (t = 1 for decode, k + 1 for a verify block; -1 = padding).
    logits_indices: int32 [b, n] picks which of the t tokens get logits (None: all).
    capture_layers: the residual streams after those layers come back concatenated (a
    drafter's features), as the families' `forward` gives them.
    Returns (logits f32 [b, n, v], hidden states [b, t, len(capture_layers) d] or None, the
    cache updated in place). Under a mesh (`sharding.active_mesh`, as the engine traces with
    tensor_parallel_size > 1) it runs `sharded_forward`.
    """
    if tp[1] == 1:  # under the engine's mesh (tensor parallel): each device runs its shard
        from weld.models.common import sharding

        mesh = sharding.active_mesh()
        if mesh is not None:
            return sharded_forward(weights, cfg, tokens, positions, cache, batch, logits_indices, capture_layers,
                                   mesh=mesh, options=options)
    b, t = tokens.shape
    interpret = options.interpret
    if interpret is None:
        interpret = False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    params = kernel_params(cfg, weights)
    paged = [p for p in cache.layers if not isinstance(p, RecurrentState)]
    latent = bool(paged) and isinstance(paged[0], LatentPages)
    k_pools = [p.pool if latent else p.k for p in paged]
    v_pools = None if latent else [p.v for p in paged]
    states = [(s.conv, s.state) for s in cache.layers if isinstance(s, RecurrentState)]
    spec = spec_for(cfg, batch=b, tokens_per_row=t, page_size=cache.page_size, weight_dtype=params["embed"].dtype,
                    kv_dtype=k_pools[0].dtype, pages_per_kv_tile=options.pages_per_kv_tile,
                    kv_ring_depth=options.kv_ring_depth,
                    int8=isinstance(params["lm_head"], Int8Matrix), float_matrices=float_matrices(params),
                    float_dtype=params["embed"].dtype, int4_experts=int4_experts(params),
                    expert_shards=expert_shards * moe_ranks, moe_ranks=moe_ranks, kv_pool_heads=kv_pool_heads)
    logits, _, k, v, hidden, states = decode_step(
        spec, params, tokens, positions, batch.block_tables, k_pools, v_pools, linear_states=states,
        state_slots=batch.state_slots, tile_rows=options.tile_rows, vocab_tile_rows=options.vocab_tile_rows,
        ring_depth=options.ring_depth, generation=options.generation, interpret=interpret, route=router(cfg),
        capture_layers=tuple(capture_layers), tp_axis=tp[0], tp_size=tp[1], dp_axis="dp" if moe_ranks > 1 else None)
    if logits_indices is not None:
        logits = jnp.take_along_axis(logits, logits_indices[:, :, None], axis=1)
    pages = iter([LatentPages(kp) for kp in k] if latent else [(kp, vp) for kp, vp in zip(k, v)])
    recurrent = iter(RecurrentState(conv=w, state=s) for w, s in states)

    def updated(old):
        if isinstance(old, RecurrentState):
            return next(recurrent)
        if isinstance(old, KVPages):
            kp, vp = next(pages)
            return dataclasses.replace(old, k=kp, v=vp)
        return next(pages)
    layers = [updated(old) for old in cache.layers]
    out = jnp.concatenate(hidden, axis=-1) if hidden else None
    return logits, out, Cache(layers=layers)


TPU_CHIPS = {"v5e": "TPU_V5E", "v6e": "TPU_V6E", "v7": "TPU_7X"}  # generation -> JAX's `tpu_info.ChipVersion`
# generation -> a topology libtpu compiles for with no TPU attached (`compile_for_tpu`)
TPU_TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v7": "tpu7x:2x2x1"}


def lower_for_tpu(cfg, *, batch: int, generation: str = "v6e", dtype=jnp.bfloat16, page_size: int = 16,
                  num_pages: int = 64) -> str:
    """The Mosaic lowering of one decode step of cfg's megakernel for a TPU of `generation`, on
    any machine: abstract weights and cache (nothing allocated), `lowering_platforms=("tpu",)`.
    Every op of the kernel body must have a Pallas TPU lowering rule (interpret mode runs any
    jnp, so only this catches an op Mosaic lacks); Mosaic's own passes (vector layouts, tiling,
    alignment) run when it compiles: `compile_for_tpu`. Returns the lowered module's text."""
    with _as_tpu(generation):
        step, args = _step(cfg, batch, generation, dtype, page_size, num_pages)
        return jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def compile_for_tpu(cfg, *, batch: int, generation: str = "v5e", dtype=jnp.bfloat16, weights=None,
                    tokens_per_row: int = 1, page_size: int = 16, num_pages: int = 1024, row_major_pools: bool = True):
    """One decode step of cfg's megakernel compiled by XLA and Mosaic for one chip of a TPU
    `generation`, on any machine with libtpu installed (the `jax[tpu]` wheel's; no TPU needed:
    libtpu compiles for a topology, `TPU_TOPOLOGIES`). Mosaic's passes reject what interpret
    mode and the lowering accept (a DMA or slice off the (8, 128) tiles, an unsupported shape
    cast or operand type): this is the check short of running on a chip. `weights`: the
    prepared tree (e.g. quantized; only shapes and dtypes are used), else abstract `dtype`
    weights. The cache is placed as the engine places it (`sharding.cache_placement`: row-major
    pools, unless row_major_pools is False) and comes back donated. Returns the compiled
    executable. JAX_PLATFORMS=cpu keeps the process off any TPU."""
    import importlib.util

    if generation not in TPU_TOPOLOGIES:
        raise ValueError(f"generation must be one of {sorted(TPU_TOPOLOGIES)}, got {generation!r}")
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError("compile_for_tpu needs libtpu (pip install 'jax[tpu]'; `make install-test` puts it in "
                           ".venv/libtpu: add that folder to PYTHONPATH)")
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from weld.models.common import sharding as sharding_lib

    device = topologies.get_topology_desc(TPU_TOPOLOGIES[generation], "tpu").devices[0]
    sharding = NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())
    with _as_tpu(generation):
        step, args = _step(cfg, batch, generation, dtype, page_size, num_pages, weights, tokens_per_row)
        placement = sharding_lib.cache_placement(args[3], None, row_major_pools=row_major_pools, device=device)
        placement = placement or jax.tree.map(lambda _: sharding, args[3])
        step = jax.jit(step, donate_argnums=(3,), out_shardings=(sharding, placement))
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
        args = args[:3] + (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), args[3],
                                        placement),) + args[4:]
        return step.trace(*args).lower().compile()


class _as_tpu:
    """Off a TPU, JAX's local device kind registered as `generation` for the lowering's
    questions about the TPU (`tpu_info.registry`, a private table of JAX 0.10.2)."""

    def __init__(self, generation: str):
        if generation not in TPU_CHIPS:
            raise ValueError(f"generation must be one of {sorted(TPU_CHIPS)}, got {generation!r}")
        self.generation, self.kind = generation, None

    def __enter__(self):
        from jax._src.pallas.mosaic import tpu_info

        if jax.default_backend() != "tpu" and jax.devices()[0].device_kind not in tpu_info.registry:
            self.kind, chip = jax.devices()[0].device_kind, getattr(tpu_info.ChipVersion, TPU_CHIPS[self.generation])
            tpu_info.registry[self.kind] = lambda: tpu_info.get_tpu_info_for_chip(chip, 1)
        return self

    def __exit__(self, *exc):
        from jax._src.pallas.mosaic import tpu_info

        if self.kind is not None:
            del tpu_info.registry[self.kind]


def _step(cfg, batch, generation, dtype, page_size, num_pages, weights=None, tokens_per_row=1):
    """The jitted kernel step and its abstract arguments (weights, tokens, positions, cache, tables)."""
    from weld.models import FAMILIES
    from weld.models.common.spec import abstract_weights
    from weld.models.family import WeightTarget

    family = next(f for f in FAMILIES if isinstance(cfg, f.Config))
    if weights is None:
        weights = jax.eval_shape(lambda w: family.prepare_weights(w, cfg, WeightTarget(backend="megakernel")),
                                 abstract_weights(family.weight_specs(cfg), dtype))
    cache_spec = family.cache_spec(cfg)
    # as many state slots as a served model's (live rows and prefix-cache snapshots), not the batch's
    cache = jax.eval_shape(lambda: cache_spec.create(num_pages, page_size, dtype, num_slots=max(batch, 256)))
    options = KernelOptions(generation=generation, interpret=False)
    tokens = jax.ShapeDtypeStruct((batch, tokens_per_row), jnp.int32)
    tables = jax.ShapeDtypeStruct((batch, len(cache_spec.page_groups()) * max(1, num_pages // batch)), jnp.int32)
    def step(w, t, p, c, bt):  # logits and the cache
        out = forward(w, cfg, t, p, c, AttentionBatch(bt), options=options)
        return out[0], out[2]
    return step, (weights, tokens, tokens, cache, tables)
