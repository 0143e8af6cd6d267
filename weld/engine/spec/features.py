"""What a drafter reads from the target: the residual stream after chosen layers.

`llama.forward` returns only the final (normed) hidden states, so this is a small dense twin of
it for whole sequences (no paged cache): the same pieces (RMSNorm, rotary embeddings, GQA
attention, SwiGLU, from weld.models) in the same order, with a plain causal mask. Training uses it
to compute the drafter's context offline; a test checks its final hidden states and logits
against `llama.forward`, and its per-layer states against `llama.forward` cut after each layer.

At serving time the runner needs the same numbers from the paged forward: for every token the
target processes, x_l [d] = the residual stream after layer l (the input of layer l+1, before any
norm), for each l in the drafter's `target_layers`, concatenated in that order -> [t, n * d].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from weld.models import llama
from weld.models.common.layers import apply_rope, linear, rms_norm

_MASKED = -1e30


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Dense GQA attention: q [b, t, h, e] over k / v [b, s, kv, e] where visible [b or 1, t, s].

    Every query must see at least one key. Returns [b, t, h * e] in q's dtype.
    """
    b, t, h, e = q.shape
    kv_heads = k.shape[2]
    qg = (q.astype(jnp.float32) * e ** -0.5).reshape(b, t, kv_heads, h // kv_heads, e)
    scores = jnp.einsum("btkge,bske->bkgts", qg, k.astype(jnp.float32))
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, _MASKED), axis=-1)
    out = jnp.einsum("bkgts,bske->btkge", probs, v.astype(jnp.float32))
    return out.reshape(b, t, h * e).astype(q.dtype)


def _causal_mask(t: int, window: int | None) -> jax.Array:
    """[1, t, t]: query i sees keys j <= i (and j > i - window)."""
    query, key = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    visible = key <= query
    if window is not None:
        visible &= key > query - window
    return visible[None]


def target_hidden_states(weights: dict, cfg: llama.Config, tokens: jax.Array,
                         layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The target over whole sequences tokens int32 [b, t] (positions 0..t-1; right padding is
    harmless under the causal mask).

    Returns (selected [b, t, len(layers) * d]: the residual stream after each layer in `layers`,
    concatenated; final [b, t, d]: the final-normed hidden states, whose LM head gives the logits).
    """
    b, t = tokens.shape
    h, kv_heads, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inv_freq, mscale = llama._rope_tables(cfg)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = weights["embed"][tokens]  # [b, t, d]
    selected = []
    for i, lw in enumerate(weights["layers"]):
        y = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
        q, k, v = llama.qkv_projections(lw, y, cfg)
        q, k, v = q.reshape(b, t, h, e), k.reshape(b, t, kv_heads, e), v.reshape(b, t, kv_heads, e)
        if cfg.qk_norm:
            q = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq, mscale)
        k = apply_rope(k, positions, inv_freq, mscale)
        x = x + linear(masked_attention(q, k, v, _causal_mask(t, cfg.window_for(i))), lw["wo"], lw.get("bo"))
        x = x + llama.mlp(lw, rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps))
        if i in layers:
            selected.append((layers.index(i), x))
    if len(selected) != len(layers):
        raise ValueError(f"target layers {layers} are not all in [0, {cfg.num_layers})")
    stacked = jnp.concatenate([x for _, x in sorted(selected, key=lambda s: s[0])], axis=-1)
    return stacked, rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)


def lm_head(weights: dict) -> jax.Array:
    """The target's output matrix [v, d] (the embedding when tied)."""
    return weights.get("lm_head", weights["embed"])
