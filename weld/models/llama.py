"""The dense decoder family: Llama 1/2/3, SmolLM2, Mistral, Qwen2 and Qwen3.

They differ only in switches on one architecture: RMSNorm pre-norm blocks, GQA attention with
rotary embeddings (optionally llama3/linear/yarn scaled), SwiGLU MLP. Qwen2 adds biases to
q/k/v, Qwen3 RMS-normalises q and k per head, Mistral may use a sliding window, and small
models tie the LM head to the embedding.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from weld.models.common.attention import paged_attention
from weld.models.common.cache import AttentionBatch, PagedKVCache, PagedKVSpec
from weld.models.common.layers import (PackedWeight, RopeScaling, apply_rope, linear, pack_weight, rms_norm,
                                      rope_inv_freq, swiglu)
from weld.models.common.spec import WeightSpec

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Frozen and hashable: it is a static argument of jit."""

    architecture: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF's rope_freqs (llama3), divides inv_freq
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # "full_attention" | "sliding_attention" per layer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        def check(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"invalid {self.architecture} config: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        check(self.num_heads % self.num_kv_heads == 0,
              f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        check(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        check(self.rope_scaling.kind in RopeScaling.SUPPORTED,
              f"rope scaling {self.rope_scaling.kind!r} is not supported (supported: {RopeScaling.SUPPORTED})")
        if self.rope_freq_factors is not None:
            check(len(self.rope_freq_factors) == self.head_dim // 2,
                  f"rope_freqs has {len(self.rope_freq_factors)} entries, expected {self.head_dim // 2}")
        if self.layer_types is not None:
            check(len(self.layer_types) == self.num_layers,
                  f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    # ----- parsing -----

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Config":
        """Parses a HF `config.json` dict (both the rope_theta/rope_scaling and rope_parameters spellings)."""
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None and model_type in GGUF_ARCHITECTURES:
            arch = model_type
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}; weld supports "
                f"{sorted(HF_ARCHITECTURES)}")
        text = config.get("text_config") or config

        def req(key: str):
            if key not in text:
                raise ValueError(f"config.json has no {key!r} (architecture {arch})")
            return text[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        head_dim = text.get("head_dim") or hidden // heads
        theta, scaling = _rope_from_hf(text)
        window = None
        layer_types = None
        if arch == "mistral":
            window = text.get("sliding_window")
        elif arch in ("qwen2", "qwen3") and text.get("use_sliding_window"):
            window = text.get("sliding_window")
            max_window_layers = text.get("max_window_layers", 0)
            layer_types = tuple("sliding_attention" if i >= max_window_layers else "full_attention"
                                for i in range(int(req("num_hidden_layers"))))
        if text.get("layer_types") and window is not None:
            layer_types = tuple(text["layer_types"])
        if text.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported by weld's llama family")
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        attention_bias = bool(text.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch in ("llama", "mistral", "qwen3") and attention_bias,
            qk_norm=arch == "qwen3",
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            bos_token_id=text.get("bos_token_id", config.get("bos_token_id")),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_names: set[str] | frozenset[str] = frozenset(),
                  rope_freq_factors: tuple[float, ...] | None = None) -> "Config":
        """Parses GGUF metadata; `tensor_names` tells tied embeddings, biases and q/k norms apart."""
        gguf_arch = metadata.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; weld supports "
                             f"{sorted(GGUF_ARCHITECTURES)}")
        arch = GGUF_ARCHITECTURES[gguf_arch]

        def key(name: str, default: Any = KeyError):
            full = f"{gguf_arch}.{name}"
            if full in metadata:
                return metadata[full]
            if default is KeyError:
                raise ValueError(f"GGUF metadata has no {full!r}")
            return default

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv_heads = key("attention.head_count_kv", heads)
        if isinstance(kv_heads, (list, tuple)):
            if len(set(kv_heads)) != 1:
                raise ValueError("per-layer head_count_kv is not supported")
            kv_heads = kv_heads[0]
        head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
        vocab = key("vocab_size", None)
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ValueError("GGUF metadata has neither a vocab_size nor tokenizer.ggml.tokens")
            vocab = len(tokens)
        scaling = RopeScaling()
        kind = key("rope.scaling.type", "none")
        if kind in ("linear", "yarn"):
            scaling = RopeScaling(kind=kind, factor=float(key("rope.scaling.factor")),
                                  original_max_position_embeddings=key("rope.scaling.original_context_length", None))
        elif kind not in ("none", None):
            raise ValueError(f"unsupported GGUF rope scaling {kind!r}")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        eot = metadata.get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(int(e) for e in (eos, eot) if e is not None))
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            sliding_window=key("attention.sliding_window", None) or None,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
        )

    # ----- derived -----

    @property
    def kv_spec(self) -> PagedKVSpec:
        return PagedKVSpec(self.num_layers, self.num_kv_heads, self.head_dim)

    def window_for(self, layer: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def num_params(self) -> int:
        from weld.models.common.spec import iter_specs
        import math

        return sum(math.prod(s.shape) for _, s in iter_specs(weight_specs(self)))


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type spelling
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling")
    if params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
    if not scaling:
        return theta, RopeScaling()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "dynamic":
        # Dynamic NTK only changes frequencies beyond the trained context, which weld's
        # max_position_embeddings forbids; within it, it equals the default.
        kind = "default"
    if kind not in RopeScaling.SUPPORTED:
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: {RopeScaling.SUPPORTED})")
    return theta, RopeScaling(
        kind=kind,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=scaling.get("original_max_position_embeddings"),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        attention_factor=scaling.get("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


def weight_specs(cfg: Config) -> dict:
    """The weight tree, declared once. Matrices are [out, in] as in HF and GGUF files."""
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * e, cfg.num_kv_heads * e

    def layer() -> dict:
        spec = {
            "attn_norm": WeightSpec((d,), ("embed",), init="ones"),
            "wq": WeightSpec((q_dim, d), ("q_heads", "embed")),
            "wk": WeightSpec((kv_dim, d), ("kv_heads", "embed")),
            "wv": WeightSpec((kv_dim, d), ("kv_heads", "embed")),
            "wo": WeightSpec((d, q_dim), ("embed", "q_heads")),
            "mlp_norm": WeightSpec((d,), ("embed",), init="ones"),
            "w_gate": WeightSpec((f, d), ("mlp", "embed")),
            "w_up": WeightSpec((f, d), ("mlp", "embed")),
            "w_down": WeightSpec((d, f), ("embed", "mlp")),
        }
        if cfg.qkv_bias:
            spec["bq"] = WeightSpec((q_dim,), ("q_heads",), init="zeros")
            spec["bk"] = WeightSpec((kv_dim,), ("kv_heads",), init="zeros")
            spec["bv"] = WeightSpec((kv_dim,), ("kv_heads",), init="zeros")
        if cfg.o_bias:
            spec["bo"] = WeightSpec((d,), ("embed",), init="zeros")
        if cfg.qk_norm:
            spec["q_norm"] = WeightSpec((e,), (None,), init="ones")
            spec["k_norm"] = WeightSpec((e,), (None,), init="ones")
        return spec

    tree = {
        "embed": WeightSpec((cfg.vocab_size, d), ("vocab", "embed")),
        "layers": [layer() for _ in range(cfg.num_layers)],
        "final_norm": WeightSpec((d,), ("embed",), init="ones"),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = WeightSpec((cfg.vocab_size, d), ("vocab", "embed"))
    return tree


@functools.lru_cache(maxsize=16)
def _rope_tables(cfg: Config):
    inv_freq, mscale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                     cfg.max_position_embeddings)
    if cfg.rope_freq_factors is not None:
        import numpy as np

        inv_freq = inv_freq / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
    return inv_freq, mscale


def fuse_projections(weights: dict) -> dict:
    """Concatenates each layer's q/k/v projections (and biases) into one `wqkv` [q + 2 kv, d]
    (`bqkv`) and gate/up into one `w_gate_up` [2 f, d], in place, layer by layer (the old
    matrices are dropped as the new ones are made, so memory peaks one layer above the model).

    Same model, fewer and wider matmuls: on the 2-core CPU box a batch-1 decode step is ~12%
    faster (benchmarks/results/cpu_decode_2026-11-30.md). `forward` and the helpers below take
    either form. Not for the megakernel, whose weight stream names the separate matrices, nor
    for weights sharded along their output dimension (q, k and v would mix across shards).
    """
    for lw in weights["layers"]:
        if "wq" in lw:
            lw["wqkv"] = jnp.concatenate([lw.pop("wq"), lw.pop("wk"), lw.pop("wv")])
            if "bq" in lw:
                lw["bqkv"] = jnp.concatenate([lw.pop("bq"), lw.pop("bk"), lw.pop("bv")])
        if "w_gate" in lw:
            lw["w_gate_up"] = jnp.concatenate([lw.pop("w_gate"), lw.pop("w_up")])
        jax.block_until_ready(lw)
    return weights


PROJECTIONS = ("wqkv", "w_gate_up", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def pack_weights(weights: dict) -> dict:
    """Stores each layer's f32 projection matrices and the LM head as `layers.PackedWeight`
    panels, in place, layer by layer, for the native CPU kernel (`linear` takes either form).
    A tied embedding is packed too (lookups gather its rows from the panels); an untied one
    only serves lookups and stays as it is."""

    def pack(w):
        if w is not None and not isinstance(w, PackedWeight) and w.ndim == 2 and w.dtype == jnp.float32:
            return jax.block_until_ready(pack_weight(w))
        return w

    for lw in weights["layers"]:
        for name in PROJECTIONS:
            if name in lw:
                lw[name] = pack(lw[name])
    head = "lm_head" if "lm_head" in weights else "embed"
    weights[head] = pack(weights[head])
    return weights


def qkv_projections(lw: dict, y: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., h * e], k and v [..., kv * e] of the normed input y, from fused or separate weights."""
    if "wqkv" in lw:
        qkv = linear(y, lw["wqkv"], lw.get("bqkv"))
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return qkv[..., :qd], qkv[..., qd:qd + kd], qkv[..., qd + kd:]
    return linear(y, lw["wq"], lw.get("bq")), linear(y, lw["wk"], lw.get("bk")), linear(y, lw["wv"], lw.get("bv"))


def mlp(lw: dict, y: jax.Array) -> jax.Array:
    """The SwiGLU MLP of the normed input y, from a fused gate/up matrix or separate ones."""
    if "w_gate_up" in lw:
        gate_up = linear(y, lw["w_gate_up"])
        f = gate_up.shape[-1] // 2
        return linear(jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:], lw["w_down"])
    return swiglu(y, lw["w_gate"], lw["w_up"], lw["w_down"])


def forward(weights: dict, cfg: Config, tokens, positions, cache: PagedKVCache, batch: AttentionBatch,
            logits_indices=None, capture_layers: tuple[int, ...] = ()):
    """One forward pass over padded token chunks on the paged cache.

    tokens, positions: int32 [b, t]; position -1 marks padding. Each token's K/V is written
    to its page, then every token attends causally over its row's pages.
    logits_indices: int32 [b, n] picks which of the t tokens get logits (None: all).
    Returns logits f32 [b, n, v], final hidden states [b, t, d] and the updated cache.
    capture_layers: with layer indices, the hidden states returned are instead the residual
    streams after those layers, concatenated [b, t, len(capture_layers) * d] (what a DSpark
    drafter reads as its context).

    A mixed batch (chunked prefills and decodes in one call) passes tuples: tokens, positions,
    batch.block_tables and logits_indices hold one entry per group of rows ([b_g, t_g] each,
    e.g. prefill chunks [bp, tp] and decode rows [bd, 1]), and logits and hidden come back as
    tuples. Every matmul runs once over all groups' tokens (the weights are read once); only
    attention runs per group.
    """
    grouped = isinstance(tokens, (tuple, list))
    groups = tuple(tokens) if grouped else (tokens,)
    group_positions = tuple(positions) if grouped else (positions,)
    group_tables = tuple(batch.block_tables) if grouped else (batch.block_tables,)
    group_indices = tuple(logits_indices) if grouped and logits_indices is not None else (logits_indices,) * len(groups)
    shapes = [g.shape for g in groups]
    sizes = [b * t for b, t in shapes]
    splits = list(itertools.accumulate(sizes))[:-1]
    h, kvh, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv_freq, mscale = _rope_tables(cfg)
    flat_positions = jnp.concatenate([p.reshape(-1) for p in group_positions])[None]  # [1, N]
    x = weights["embed"][jnp.concatenate([g.reshape(-1) for g in groups])]  # [N, d]
    new_k, new_v = [], []
    captured = {}
    for i, lw in enumerate(weights["layers"]):
        y = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
        q, k, v = qkv_projections(lw, y, cfg)
        q, k, v = q.reshape(1, -1, h, e), k.reshape(1, -1, kvh, e), v.reshape(1, -1, kvh, e)
        if cfg.qk_norm:
            q = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, flat_positions, inv_freq, mscale)[0]  # [N, h, e]
        k = apply_rope(k, flat_positions, inv_freq, mscale)[0]
        v = v[0]
        k_pages, v_pages = cache.k[i], cache.v[i]
        outs = []
        for (b, t), qg, kg, vg, pos, tables in zip(shapes, jnp.split(q, splits), jnp.split(k, splits),
                                                    jnp.split(v, splits), group_positions, group_tables):
            out, k_pages, v_pages = paged_attention(
                qg.reshape(b, t, h, e), kg.reshape(b, t, kvh, e), vg.reshape(b, t, kvh, e), k_pages, v_pages,
                pos, tables, sliding_window=cfg.window_for(i))
            outs.append(out.reshape(b * t, h * e))
        new_k.append(k_pages)
        new_v.append(v_pages)
        attn = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
        x = x + linear(attn, lw["wo"], lw.get("bo"))
        x = x + mlp(lw, rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps))
        if i in capture_layers:
            captured[i] = x
    if len(captured) != len(capture_layers):
        raise ValueError(f"capture_layers {capture_layers} must lie in [0, {cfg.num_layers})")
    hidden = rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    states = jnp.concatenate([captured[i] for i in capture_layers], axis=-1) if capture_layers else hidden
    head = weights.get("lm_head", weights["embed"])
    all_logits, all_hidden = [], []
    for (b, t), hg, sg, idx in zip(shapes, jnp.split(hidden, splits), jnp.split(states, splits), group_indices):
        hg = hg.reshape(b, t, -1)
        selected = hg if idx is None else jnp.take_along_axis(hg, idx[:, :, None], axis=1)
        all_logits.append(linear(selected, head).astype(jnp.float32))
        all_hidden.append(sg.reshape(b, t, -1))
    cache = PagedKVCache(k=new_k, v=new_v)
    if grouped:
        return tuple(all_logits), tuple(all_hidden), cache
    return all_logits[0], all_hidden[0], cache
