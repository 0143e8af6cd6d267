"""The llama family (dense and MoE) and the deepseek family (MLA + MoE) on the TPU decode megakernel.

The kernel (`weld.kernels.megakernel.decode`) knows plain numbers and arrays; this adapter maps a
family's `Config` to its `MegakernelSpec`, the family's weight tree to the kernel's operands
(the per-layer matrices themselves, in stream order: no copy), and offers `forward` with the
family's contract for calls of a few tokens per row (decode: 1; a verify block: k + 1), so the
engine's fused decode loop runs it in place of the family's `forward`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from weld.kernels.megakernel.decode import MATRICES, Int8Matrix, decode_step
from weld.kernels.megakernel.plan import MegakernelSpec
from weld.models import deepseek, llama
from weld.models.common import moe as moe_lib
from weld.models.common.cache import AttentionBatch, Cache, KVPages, LatentPages
from weld.models.common.quant import QuantWeight

# the kernel's matrix names -> the family's weight names (a sparse layer's under lw["moe"]: the
# expert stacks under the same names, the shared expert's under "shared")
_WEIGHT_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down",
                 "q_a": "wq_a", "q_b": "wq_b", "kv_a": "wkv_a", "w_uk": "w_uk", "w_uv": "w_uv"}
_SHARED_NAMES = {"shared_gate": "w_gate", "shared_up": "w_up", "shared_down": "w_down"}


def check_supported(cfg) -> None:
    """Raises ValueError for what the megakernel does not cover."""
    if not isinstance(cfg, (llama.Config, deepseek.Config)):
        raise ValueError(f"the megakernel runs the llama and deepseek families, got a {type(cfg).__module__} config")
    if isinstance(cfg, deepseek.Config) and cfg.mla.rope is None:
        raise ValueError("the megakernel's MLA needs a rotary part (NoPE layers are not covered); use backend='xla'")
    moe = cfg.moe
    if moe is not None and (moe.expert_bias or moe.activation != "swiglu"):
        raise ValueError(f"the megakernel's experts are SwiGLU without biases ({cfg.architecture} has "
                         f"activation {moe.activation!r}, expert biases {moe.expert_bias}); use backend='xla'")
    if isinstance(cfg, llama.Config) and any(cfg.window_for(i) is not None for i in range(cfg.num_layers)):
        raise ValueError(f"the megakernel has no sliding-window attention (sliding_window={cfg.sliding_window}); "
                         "use backend='xla'")


def spec_for(cfg, *, batch: int, tokens_per_row: int = 1, page_size: int, weight_dtype, kv_dtype,
             pages_per_kv_tile: int = 8, int8: bool = False) -> MegakernelSpec:
    """The kernel's spec for `cfg` at this batch shape."""
    check_supported(cfg)
    mla = cfg.mla if isinstance(cfg, deepseek.Config) else None
    _, mscale = (mla.rope if mla else cfg.rope).tables()
    moe = cfg.moe
    experts = {} if moe is None or not cfg.sparse_layers else dict(
        sparse_layers=tuple(cfg.sparse_layers), num_experts=moe.num_experts, top_k=moe.top_k,
        expert_intermediate=moe.intermediate_size, shared_intermediate=moe.shared_intermediate_size,
        shared_expert_gate=moe.shared_gate, router_bias=moe.router_bias or moe.score_bias)
    if mla:  # one latent key head of kv_lora_rank + rope_dim
        attention = dict(num_heads=mla.num_heads, num_kv_heads=1, head_dim=mla.kv_lora_rank + mla.rope_dim,
                         attention="mla", q_lora_rank=mla.q_lora_rank or 0, kv_lora_rank=mla.kv_lora_rank,
                         nope_dim=mla.nope_dim, rope_dim=mla.rope_dim, v_dim=mla.v_dim,
                         rope_interleaved=mla.rope.interleaved, attn_scale=float(mla.scale))
    else:
        attention = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm)
    return MegakernelSpec(
        hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, num_layers=cfg.num_layers,
        weight_bytes=1 if int8 else jnp.dtype(weight_dtype).itemsize, kv_bytes=jnp.dtype(kv_dtype).itemsize,
        batch=batch, tokens_per_row=tokens_per_row, page_size=page_size, pages_per_kv_tile=pages_per_kv_tile,
        scale_bytes=4 if int8 else 0, rms_norm_eps=cfg.rms_norm_eps, rope_mscale=float(mscale), **attention,
        **experts)


def kernel_params(cfg, weights: dict) -> dict:
    """The kernel's params from the family's weight tree. The matrices are the tree's own arrays:
    float, or int8 per output channel as quantized at load (`quant.QuantWeight`, "int8_channel");
    only the small vectors are stacked per call. A tied embedding quantized as the LM head is
    looked up in `prepare_weights`' float copy ("embed_table")."""
    layers = weights["layers"]
    mla = cfg.mla if isinstance(cfg, deepseek.Config) else None
    inv_freq, _ = (mla.rope if mla else cfg.rope).tables()
    params = {
        "embed": weights.get("embed_table", weights["embed"]),
        "lm_head": _matrix(weights.get("lm_head", weights["embed"])),
        "layers": [_layer_params(lw, mla is not None) for lw in layers],
        "attn_norm": jnp.stack([lw["attn_norm"] for lw in layers]),
        "mlp_norm": jnp.stack([lw["mlp_norm"] for lw in layers]),
        "final_norm": weights["final_norm"],
        "inv_freq": jnp.asarray(np.asarray(inv_freq), jnp.float32),
    }
    if mla:
        params["kv_a_norm"] = jnp.stack([lw["kv_a_norm"] for lw in layers])
        if mla.q_lora_rank:
            params["q_a_norm"] = jnp.stack([lw["q_a_norm"] for lw in layers])
    elif cfg.qkv_bias:
        params["qkv_bias"] = jnp.stack([jnp.concatenate([lw["bq"], lw["bk"], lw["bv"]]) for lw in layers])
    if not mla and cfg.o_bias:
        params["o_bias"] = jnp.stack([lw["bo"] for lw in layers])
    if not mla and cfg.qk_norm:
        params["q_norm"] = jnp.stack([lw["q_norm"] for lw in layers])
        params["k_norm"] = jnp.stack([lw["k_norm"] for lw in layers])
    moe = cfg.moe
    if moe is not None and cfg.sparse_layers:  # per-layer vectors of the sparse layers (zeros elsewhere)
        def per_layer(key, width, pick):
            return jnp.stack([pick(lw["moe"][key]).astype(jnp.float32) if "moe" in lw else jnp.zeros((width,), jnp.float32)
                              for lw in layers])
        if moe.router_bias or moe.score_bias:
            key = "router_bias" if moe.router_bias else "score_bias"
            params["router_bias"] = per_layer(key, moe.num_experts, lambda a: a)
        if moe.shared_gate:
            params["shared_expert_gate"] = per_layer("shared_gate", cfg.hidden_size, lambda a: a.reshape(-1))
    return params


def _layer_params(lw: dict, mla: bool) -> dict:
    """One layer's matrices under the kernel's names: a sparse layer's expert stacks, router
    and shared expert from lw["moe"]; MLA's W_UK / W_UV [heads, dims, latent] as [heads x dims,
    latent] (a reshape: the same bytes)."""
    names = [n for n in ("q", "q_a", "q_b", "kv_a", "w_uk", "w_uv", "o") if _WEIGHT_NAMES[n] in lw] if mla else MATRICES[:4]
    out = {name: _matrix(lw[_WEIGHT_NAMES[name]]) for name in names}
    for name in ("w_uk", "w_uv"):
        if name in out:
            if isinstance(out[name], Int8Matrix):
                raise ValueError("the megakernel's MLA takes float weights (W_UK / W_UV are not quantized)")
            out[name] = out[name].reshape(-1, out[name].shape[-1])
    mlp = lw.get("moe", lw)
    out.update({name: _matrix(mlp[_WEIGHT_NAMES[name]]) for name in MATRICES[4:]})
    if "moe" in lw:
        out["router"] = mlp["router"]
        out.update({name: _matrix(mlp["shared"][key]) for name, key in _SHARED_NAMES.items() if "shared" in mlp})
    return out


def router(cfg):
    """The kernel's `route` for cfg: the family's own routing rule (`moe.route`)."""
    if cfg.moe is None:
        return None
    return lambda scores, bias: moe_lib.route(cfg.moe, scores, None if bias is None else bias[0])


def _matrix(w):
    """A float matrix as it is; a QuantWeight as the kernel's `Int8Matrix` of its own arrays."""
    if not isinstance(w, QuantWeight):
        return w
    if w.fmt != "int8_channel":
        raise ValueError(f"the megakernel streams float or int8 per-channel matrices, not {w.fmt} blocks: "
                         "load with quantization 'int8_channel' or 'none'")
    return Int8Matrix(w.codes, w.scales)  # an expert stack's: [E, out, in] codes, [E, out] scales


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the kernel is tiled and run (hashable: a static argument under jit)."""

    tile_rows: int = 256
    vocab_tile_rows: int = 256
    ring_depth: int = 4
    pages_per_kv_tile: int = 8
    generation: str | None = None  # None: detected on a TPU, unchecked in interpret mode
    interpret: object = None  # None: interpret mode (default InterpretParams) unless on a TPU


def forward(weights: dict, cfg, tokens, positions, cache: Cache, batch: AttentionBatch, logits_indices=None,
            capture_layers: tuple[int, ...] = (), *, options: KernelOptions = KernelOptions()):
    """The family's forward contract for one group of rows with few tokens each, on the megakernel
    (the llama family's K/V pages, or the deepseek family's latent pages).

    tokens, positions: int32 [b, t] (t = 1 for decode, k + 1 for a verify block; -1 = padding).
    logits_indices: int32 [b, n] picks which of the t tokens get logits (None: all).
    capture_layers: the residual streams after those layers come back concatenated (a
    drafter's features), as `llama.forward` gives them.
    Returns (logits f32 [b, n, v], hidden states [b, t, len(capture_layers) d] or None, the
    cache updated in place).
    """
    b, t = tokens.shape
    interpret = options.interpret
    if interpret is None:
        interpret = False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    params = kernel_params(cfg, weights)
    latent = isinstance(cache.layers[0], LatentPages)
    k_pools = [p.pool if latent else p.k for p in cache.layers]
    v_pools = None if latent else [p.v for p in cache.layers]
    spec = spec_for(cfg, batch=b, tokens_per_row=t, page_size=k_pools[0].shape[1], weight_dtype=params["embed"].dtype,
                    kv_dtype=k_pools[0].dtype, pages_per_kv_tile=options.pages_per_kv_tile,
                    int8=isinstance(params["lm_head"], Int8Matrix))
    logits, _, k, v, hidden = decode_step(spec, params, tokens, positions, batch.block_tables, k_pools, v_pools,
                                          tile_rows=options.tile_rows,
                                          vocab_tile_rows=options.vocab_tile_rows, ring_depth=options.ring_depth,
                                          generation=options.generation, interpret=interpret, route=router(cfg),
                                          capture_layers=tuple(capture_layers))
    if logits_indices is not None:
        logits = jnp.take_along_axis(logits, logits_indices[:, :, None], axis=1)
    states = jnp.concatenate(hidden, axis=-1) if hidden else None
    layers = [LatentPages(kp) for kp in k] if latent else [KVPages(kp, vp) for kp, vp in zip(k, v)]
    return logits, states, Cache(layers=layers)
