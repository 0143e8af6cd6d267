"""Grouped-query self-attention on paged K/V: the attention block of the Llama, Gemma and gpt-oss
families, written once.

    q, k, v = y W_qᵀ (+ b_q), y W_kᵀ (+ b_k), y W_vᵀ (+ b_v)   (fused `wqkv` at load on XLA)
    q, k    = RMSNorm per head (Qwen3, Gemma: before RoPE), then RoPE (over the first rope.dim
              dims of each head when that is less than head_dim: Qwen3-Next's partial RoPE)
    o       = softmax(q kᵀ · scale [+ sliding window mask]) v    (+ gpt-oss's sink per head)
    out     = o W_oᵀ (+ b_o), or (o ∘ sigmoid(gate)) W_oᵀ with an output gate (Qwen3-Next: W_q's
              rows per head are [q | gate])

Einsum letters: n tokens, h query heads, k kv heads, e head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from weld.models.common.attention import paged_attention
from weld.models.common.cache import KVPages
from weld.models.common.decoder import Rows
from weld.models.common.layers import linear, rms_norm
from weld.models.common.quant import concat_rows
from weld.models.common.rope import Rope
from weld.models.common.spec import WeightSpec


@dataclasses.dataclass(frozen=True)
class GQA:
    """One family's attention shapes and switches (hashable: derived from its Config)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6  # of the q/k norms
    norm_plus_one: bool = False  # Gemma's (1 + w) norms
    sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    scale: float | None = None  # None: head_dim ** -0.5
    output_gate: bool = False  # Qwen3-Next: a sigmoid gate per head and channel on the output

    @property
    def q_width(self) -> int:
        """Rows of W_q: the queries (and, with an output gate, the gates) of every head."""
        return self.num_heads * self.head_dim * (2 if self.output_gate else 1)


def gqa_specs(g: GQA, d: int) -> dict:
    """One attention layer's weights, matrices [out, in]."""
    q_dim, kv_dim, e = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim, g.head_dim
    spec = {
        "wq": WeightSpec((g.q_width, d), ("q_heads", "embed"), quantize="linear"),
        "wk": WeightSpec((kv_dim, d), ("kv_heads", "embed"), quantize="linear"),
        "wv": WeightSpec((kv_dim, d), ("kv_heads", "embed"), quantize="linear"),
        "wo": WeightSpec((d, q_dim), ("embed", "q_heads"), quantize="linear"),
    }
    if g.qkv_bias:
        spec.update(bq=WeightSpec((g.q_width,), ("q_heads",), init="zeros"),
                    bk=WeightSpec((kv_dim,), ("kv_heads",), init="zeros"),
                    bv=WeightSpec((kv_dim,), ("kv_heads",), init="zeros"))
    if g.o_bias:
        spec["bo"] = WeightSpec((d,), ("embed",), init="zeros")
    if g.qk_norm:
        init = "zeros" if g.norm_plus_one else "ones"
        spec.update(q_norm=WeightSpec((e,), (None,), init=init), k_norm=WeightSpec((e,), (None,), init=init))
    if g.sinks:
        spec["sinks"] = WeightSpec((g.num_heads,), ("q_heads",), init="zeros")
    return spec


def qkv_projections(g: GQA, lw: dict, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., h * e], k and v [..., kv * e] of the normed input y, from fused or separate weights."""
    if "wqkv" in lw:
        qkv = linear(y, lw["wqkv"], lw.get("bqkv"))
        qd, kd = g.q_width, g.num_kv_heads * g.head_dim
        return qkv[..., :qd], qkv[..., qd:qd + kd], qkv[..., qd + kd:]
    return linear(y, lw["wq"], lw.get("bq")), linear(y, lw["wk"], lw.get("bk")), linear(y, lw["wv"], lw.get("bv"))


def self_attention(g: GQA, lw: dict, y: jax.Array, rows: Rows, pages: KVPages, *, rope: Rope | None,
                   window: int | None = None, page_group: int = 0) -> tuple[jax.Array, KVPages]:
    """Attention of normed y [N, d] (this call's K/V written to the pages first) -> ([N, d], pages).
    page_group: whose block tables the layer's pages are in (`CacheSpec.page_groups`)."""
    h, kvh, e = g.num_heads, g.num_kv_heads, g.head_dim
    q, k, v = qkv_projections(g, lw, y)
    gate = None
    if g.output_gate:
        q, gate = jnp.split(q.reshape(-1, h, 2 * e), 2, axis=-1)
    q, k, v = q.reshape(1, -1, h, e), k.reshape(1, -1, kvh, e), v.reshape(-1, kvh, e)
    if g.qk_norm:
        q = rms_norm(q, lw["q_norm"], g.norm_eps, plus_one=g.norm_plus_one)
        k = rms_norm(k, lw["k_norm"], g.norm_eps, plus_one=g.norm_plus_one)
    if rope is not None:
        angles = rows.rope_angles(rope)
        q, k = _rotate(rope, q, angles), _rotate(rope, k, angles)
    attn, pages = rows.attend(functools.partial(_attend, window=window, scale=g.scale, sinks=lw.get("sinks")),
                              pages, q[0], k[0], v, page_group=page_group)
    if gate is not None:
        attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
    return linear(attn.reshape(-1, h * e), lw["wo"], lw.get("bo")), pages


def _rotate(rope: Rope, x: jax.Array, angles) -> jax.Array:
    """x [..., e] rotated over its first rope.dim dims (all of them, usually)."""
    if rope.dim == x.shape[-1]:
        return rope.rotate(x, angles)
    return jnp.concatenate([rope.rotate(x[..., :rope.dim], angles), x[..., rope.dim:]], axis=-1)


def _attend(pages: KVPages, positions, tables, q, k, v, *, window, scale, sinks):
    out, k_pages, v_pages = paged_attention(q, k, v, pages.k, pages.v, positions, tables, sliding_window=window,
                                            scale=scale, sinks=sinks)
    return out, dataclasses.replace(pages, k=k_pages, v=v_pages)


def fuse_qkv(lw: dict) -> None:
    """Concatenates q/k/v projections (and biases) into `wqkv` [q + 2 kv, d] (`bqkv`), in place."""
    if "wq" in lw:
        fused = concat_rows([lw["wq"], lw["wk"], lw["wv"]])
        if fused is None:  # matrices of different forms (a GGUF's mixed types) stay apart
            return
        del lw["wq"], lw["wk"], lw["wv"]
        lw["wqkv"] = fused
        if "bq" in lw:
            lw["bqkv"] = jnp.concatenate([lw.pop("bq"), lw.pop("bk"), lw.pop("bv")])
