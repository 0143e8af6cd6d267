"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Kimi Linear's full layers), absorbed.

Per token, with nh heads, dn = nope dims, dr = rope dims, dv = value dims, r = kv_lora_rank:

    q      = x W_qᵀ  (or RMSNorm(x W_qaᵀ) W_qbᵀ with q LoRA)  -> [nh, dn + dr] = [q_nope | q_pe]
    kv     = x W_kvaᵀ -> [r + dr];  c_kv = RMSNorm(kv[:r]) (eps 1e-6),  k_pe = kv[r:] (one head, shared)
    q_pe, k_pe rotated (RoPE over dr dims; DeepSeek pairs them interleaved)
    W_kvb  = [W_UK | W_UV] per head: k_nope[h] = W_UK[h] c_kv,  v[h] = W_UV[h] c_kv

The absorbed form never expands K and V per head: the cache holds c_kv and k_pe (r + dr values
per token, `cache.PagedLatent`), W_UK is folded into the query and W_UV applied after attention:

    q_abs[h]  = W_UK[h]ᵀ q_nope[h]                                        [nh, r]
    s[h, t]   = (q_abs[h] . c_kv[t] + q_pe[h] . k_pe[t]) * scale
    o_lat[h]  = sum_t softmax(s[h])_t c_kv[t]                              [nh, r]
    o[h]      = W_UV[h] o_lat[h];   out = concat_h o[h] W_oᵀ

so attention is one key head of width r + dr ([c_kv | k_pe], stored once) whose first r values are
also the value: the paged attention runs with the latent pool as keys and values and the first r
outputs are kept. The scale is (dn + dr)^-1/2, times YaRN's mscale(factor, mscale_all_dim)² when
the context is extended (`mla_scale`).

Einsum letters: n tokens, h heads, e nope dims, v value dims, r latent dims.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from weld.models.common.attention import paged_attention
from weld.models.common.cache import LatentPages
from weld.models.common.checkpoint import Convert
from weld.models.common.decoder import Rows
from weld.models.common.layers import linear, rms_norm
from weld.models.common.rope import Rope, RopeScaling, yarn_mscale
from weld.models.common.spec import WeightSpec

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers hard-codes it, whatever rms_norm_eps says


@dataclasses.dataclass(frozen=True)
class MLA:
    """One family's MLA shapes (hashable: part of its Config)."""

    num_heads: int
    q_lora_rank: int | None  # None: a plain q projection (DeepSeek-V2-Lite, Kimi Linear)
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    rope: Rope | None  # None: no rotary embedding anywhere (Kimi Linear's NoPE layers)
    scale: float

    def __post_init__(self):
        for name in ("num_heads", "kv_lora_rank", "nope_dim", "rope_dim", "v_dim"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"invalid MLA config: {name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"invalid MLA config: q_lora_rank must be positive or None, got {self.q_lora_rank}")


def mla_scale(nope_dim: int, rope_dim: int, scaling: RopeScaling) -> float:
    """The softmax scale: (dn + dr)^-1/2, times mscale(factor, mscale_all_dim)² under YaRN."""
    scale = (nope_dim + rope_dim) ** -0.5
    if scaling.kind == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def mla_specs(mla: MLA, d: int) -> dict:
    """One MLA layer's weights: q (or its LoRA pair), the joint KV down-projection, W_UK and W_UV
    per head (kv_b_proj split), the output projection."""
    nh, r, dr = mla.num_heads, mla.kv_lora_rank, mla.rope_dim
    q_out = nh * (mla.nope_dim + dr)
    spec = {
        "wkv_a": WeightSpec((r + dr, d), ("latent", "embed"), quantize="linear"),
        "kv_a_norm": WeightSpec((r,), ("latent",), init="ones"),
        "w_uk": WeightSpec((nh, mla.nope_dim, r), ("q_heads", None, "latent")),
        "w_uv": WeightSpec((nh, mla.v_dim, r), ("q_heads", None, "latent")),
        "wo": WeightSpec((d, nh * mla.v_dim), ("embed", "q_heads"), quantize="linear"),
    }
    if mla.q_lora_rank is None:
        spec["wq"] = WeightSpec((q_out, d), ("q_heads", "embed"), quantize="linear")
    else:
        spec.update(wq_a=WeightSpec((mla.q_lora_rank, d), ("q_lora", "embed"), quantize="linear"),
                    q_a_norm=WeightSpec((mla.q_lora_rank,), ("q_lora",), init="ones"),
                    wq_b=WeightSpec((q_out, mla.q_lora_rank), ("q_heads", "q_lora"), quantize="linear"))
    return spec


def split_kv_b(mla: MLA):
    """A conversion of kv_b_proj [nh * (dn + dv), r] (rows per head: [k_nope dn | v dv]) into
    W_UK [nh, dn, r] and W_UV [nh, dv, r]."""

    def fn(w, _cfg):
        w = w.reshape(mla.num_heads, mla.nope_dim + mla.v_dim, -1)
        return w[:, :mla.nope_dim], w[:, mla.nope_dim:]

    return fn


def mla_hf_keys(attn: str, path: tuple, mla: MLA) -> dict:
    """transformers' names of an MLA block under `attn` (e.g. "model.layers.{i}.self_attn.") -> the tree."""
    return {
        attn + "q_proj.weight": path + ("wq",), attn + "q_a_proj.weight": path + ("wq_a",),
        attn + "q_a_layernorm.weight": path + ("q_a_norm",), attn + "q_b_proj.weight": path + ("wq_b",),
        attn + "kv_a_proj_with_mqa.weight": path + ("wkv_a",), attn + "kv_a_layernorm.weight": path + ("kv_a_norm",),
        attn + "kv_b_proj.weight": Convert(split_kv_b(mla), path + ("w_uk",), path + ("w_uv",)),
        attn + "o_proj.weight": path + ("wo",),
    }


def mla_attention(mla: MLA, lw: dict, x: jax.Array, rows: Rows, pages: LatentPages) -> tuple[jax.Array, LatentPages]:
    """Attention of normed x [N, d] over the latent pages (this call's c_kv and k_pe written
    first). Returns (the output projection's result [N, d], the pages)."""
    nh, r, dn, dr = mla.num_heads, mla.kv_lora_rank, mla.nope_dim, mla.rope_dim
    if "wq" in lw:
        q = linear(x, lw["wq"])
    else:
        q = linear(rms_norm(linear(x, lw["wq_a"]), lw["q_a_norm"], LATENT_NORM_EPS), lw["wq_b"])
    q = q.reshape(-1, nh, dn + dr)
    kv = linear(x, lw["wkv_a"])
    c_kv = rms_norm(kv[:, :r], lw["kv_a_norm"], LATENT_NORM_EPS)  # [N, r]
    q_pe, k_pe = q[:, :, dn:], kv[:, None, r:]  # [N, nh, dr], [N, 1, dr]
    if mla.rope is not None:
        angles = rows.rope_angles(mla.rope)
        q_pe, k_pe = mla.rope.rotate(q_pe[None], angles)[0], mla.rope.rotate(k_pe[None], angles)[0]
    q_abs = jnp.einsum("nhe,her->nhr", q[:, :, :dn], lw["w_uk"].astype(q.dtype))
    query = jnp.concatenate([q_abs, q_pe.astype(q_abs.dtype)], axis=-1)  # [N, nh, r + dr]
    latent = jnp.concatenate([c_kv[:, None, :], k_pe.astype(c_kv.dtype)], axis=-1)  # [N, 1, r + dr]

    def attend(pool: LatentPages, pos, tables, qg, latent_g):
        out, pool_pages, _ = paged_attention(qg, latent_g, None, pool.pool, None, pos, tables, scale=mla.scale)
        return out[..., :r], LatentPages(pool_pages)  # the values are c_kv, the keys' first r dims

    o_lat, pages = rows.attend(attend, pages, query, latent)  # [N, nh, r]
    o = jnp.einsum("nhr,hvr->nhv", o_lat, lw["w_uv"].astype(o_lat.dtype))
    return linear(o.reshape(o.shape[0], nh * mla.v_dim), lw["wo"]), pages
