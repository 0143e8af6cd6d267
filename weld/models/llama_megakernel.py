"""The llama family (`weld.models.llama`, dense variants) on the TPU decode megakernel.

The kernel (`weld.kernels.megakernel.decode`) knows plain numbers and arrays; this adapter maps a
llama-family `Config` to its `MegakernelSpec`, the family's weight tree to the kernel's operands
(the per-layer matrices themselves, in stream order: no copy), and offers `forward` with the
family's contract for calls of a few tokens per row (decode: 1; a verify block: k + 1), so the
engine's fused decode loop runs it in place of `llama.forward`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from weld.kernels.megakernel.decode import MATRICES, Int8Matrix, decode_step
from weld.kernels.megakernel.plan import MegakernelSpec
from weld.models import llama
from weld.models.common.cache import AttentionBatch, Cache, KVPages
from weld.models.common.quant import QuantWeight

# the kernel's matrix names -> the family's weight names
_WEIGHT_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


def check_supported(cfg) -> None:
    """Raises ValueError for what the megakernel does not cover."""
    if not isinstance(cfg, llama.Config):
        raise ValueError(f"the megakernel runs the llama family only, got a {type(cfg).__module__} config")
    if cfg.moe is not None:
        raise ValueError(f"the megakernel has no mixture-of-experts layers ({cfg.architecture}); use backend='xla'")
    if any(cfg.window_for(i) is not None for i in range(cfg.num_layers)):
        raise ValueError(f"the megakernel has no sliding-window attention (sliding_window={cfg.sliding_window}); "
                         "use backend='xla'")


def spec_for(cfg, *, batch: int, tokens_per_row: int = 1, page_size: int, weight_dtype, kv_dtype,
             pages_per_kv_tile: int = 8, int8: bool = False) -> MegakernelSpec:
    """The kernel's spec for `cfg` at this batch shape."""
    check_supported(cfg)
    _, mscale = cfg.rope.tables()
    return MegakernelSpec(
        hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size, num_layers=cfg.num_layers,
        weight_bytes=1 if int8 else jnp.dtype(weight_dtype).itemsize, kv_bytes=jnp.dtype(kv_dtype).itemsize,
        batch=batch, tokens_per_row=tokens_per_row, page_size=page_size, pages_per_kv_tile=pages_per_kv_tile,
        scale_bytes=4 if int8 else 0, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm,
        rms_norm_eps=cfg.rms_norm_eps, rope_mscale=float(mscale))


def kernel_params(cfg, weights: dict) -> dict:
    """The kernel's params from the family's weight tree. The matrices are the tree's own arrays:
    float, or int8 per output channel as quantized at load (`quant.QuantWeight`, "int8_channel");
    only the small vectors are stacked per call. A tied embedding quantized as the LM head is
    looked up in `prepare_weights`' float copy ("embed_table")."""
    layers = weights["layers"]
    inv_freq, _ = cfg.rope.tables()
    params = {
        "embed": weights.get("embed_table", weights["embed"]),
        "lm_head": _matrix(weights.get("lm_head", weights["embed"])),
        "layers": [{name: _matrix(lw[_WEIGHT_NAMES[name]]) for name in MATRICES} for lw in layers],
        "attn_norm": jnp.stack([lw["attn_norm"] for lw in layers]),
        "mlp_norm": jnp.stack([lw["mlp_norm"] for lw in layers]),
        "final_norm": weights["final_norm"],
        "inv_freq": jnp.asarray(np.asarray(inv_freq), jnp.float32),
    }
    if cfg.qkv_bias:
        params["qkv_bias"] = jnp.stack([jnp.concatenate([lw["bq"], lw["bk"], lw["bv"]]) for lw in layers])
    if cfg.o_bias:
        params["o_bias"] = jnp.stack([lw["bo"] for lw in layers])
    if cfg.qk_norm:
        params["q_norm"] = jnp.stack([lw["q_norm"] for lw in layers])
        params["k_norm"] = jnp.stack([lw["k_norm"] for lw in layers])
    return params


def _matrix(w):
    """A float matrix as it is; a QuantWeight as the kernel's `Int8Matrix` of its own arrays."""
    if not isinstance(w, QuantWeight):
        return w
    if w.fmt != "int8_channel":
        raise ValueError(f"the megakernel streams float or int8 per-channel matrices, not {w.fmt} blocks: "
                         "load with quantization 'int8_channel' or 'none'")
    return Int8Matrix(w.codes, w.scales)


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
    """`llama.forward`'s contract for one group of rows with few tokens each, on the megakernel
    (no capture_layers: the kernel returns no hidden states).

    tokens, positions: int32 [b, t] (t = 1 for decode, k + 1 for a verify block; -1 = padding).
    logits_indices: int32 [b, n] picks which of the t tokens get logits (None: all).
    Returns (logits f32 [b, n, v], None (no hidden states), the cache updated in place).
    """
    if capture_layers:
        raise ValueError("the megakernel returns no hidden states: capture_layers must be empty")
    b, t = tokens.shape
    interpret = options.interpret
    if interpret is None:
        interpret = False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    params = kernel_params(cfg, weights)
    spec = spec_for(cfg, batch=b, tokens_per_row=t, page_size=cache.page_size, weight_dtype=params["embed"].dtype,
                    kv_dtype=cache.layers[0].k.dtype, pages_per_kv_tile=options.pages_per_kv_tile,
                    int8=isinstance(params["lm_head"], Int8Matrix))
    logits, _, k, v = decode_step(spec, params, tokens, positions,
                                  batch.block_tables, [p.k for p in cache.layers], [p.v for p in cache.layers],
                                  tile_rows=options.tile_rows,
                                  vocab_tile_rows=options.vocab_tile_rows, ring_depth=options.ring_depth,
                                  generation=options.generation, interpret=interpret)
    if logits_indices is not None:
        logits = jnp.take_along_axis(logits, logits_indices[:, :, None], axis=1)
    return logits, None, Cache(layers=[KVPages(kp, vp) for kp, vp in zip(k, v)])
