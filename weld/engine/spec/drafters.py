"""Device-side drafters for the runner: a separate draft model, and the DSpark block drafter.

Both keep per-token state in page pools of their own, indexed by the target's block tables (same
page size, same page count): a position's state lives where the target's K/V for it lives, so a
sequence's pages, prefix-cache hits, rollback by length and freeing serve both at once. Rejected
slots leave stale state past a row's length, overwritten before anything reads it (as the
target's K/V).

A drafter is a static object (hashable, closed over by the jitted programs) with:
  capture_layers           target layers whose residual streams `observe` needs (() = none)
  init_state(pages, page_size, dtype) -> state
  observe(params, state, tokens, positions, tables, last_index, features) -> state
      after every target forward over row groups (tuples of [b, t] arrays; features: the target's
      captured streams per group); keeps the drafter's state in step with the target's cache.
  propose(params, state, target_weights, last, positions, tables, budget, k) -> (state, drafts, num)
      last [b]: each row's last token at positions [b]; budget [b]: slots the row owns from
      there (drafting writes state only within them). Greedy drafts [b, k] (deterministic: verify
      with draft_probs=None) and how many the drafter would send [b].
  observes_verify: whether `observe` must also see the verification forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from weld.engine.spec import dspark
from weld.models.common.attention import paged_attention, write_kv
from weld.models.common.cache import AttentionBatch, PagedKVCache, PagedKVSpec
from weld.models.common.layers import linear, rms_norm, swiglu


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """A smaller model with the target's tokenizer drafts greedily, one token per forward."""

    family: Any  # the draft model's family module (forward, Config)
    cfg: Any
    capture_layers: tuple[int, ...] = ()
    observes_verify: bool = False  # propose already fed every slot the target may keep

    def init_state(self, num_pages: int, page_size: int, dtype: Any) -> PagedKVCache:
        return PagedKVCache.create(self.cfg.kv_spec, num_pages, page_size, dtype)

    def observe(self, params, state, tokens, positions, tables, last_index, features):
        _, _, state = self.family.forward(params, self.cfg, tokens, positions, state,
                                          AttentionBatch(block_tables=tables),
                                          tuple(li[:, None] for li in last_index))
        return state

    def propose(self, params, state, target_weights, last, positions, tables, budget, k: int):
        """Feeds the last token and k drafts (k + 1 forwards), so the draft cache covers every
        slot the target may accept, the bonus token's predecessor included."""
        b = last.shape[0]
        batch = AttentionBatch(block_tables=tables)

        def step(j, carry):
            state, tok, drafted = carry
            pos = jnp.where(j < budget, positions + j, -1)[:, None]  # only the row's own slots
            logits, _, state = self.family.forward(params, self.cfg, tok[:, None], pos, state, batch,
                                                   jnp.zeros((b, 1), jnp.int32))
            tok = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return state, tok, drafted.at[:, j].set(tok)

        state, _, drafted = jax.lax.fori_loop(0, k + 1, step, (state, last, jnp.zeros((b, k + 1), jnp.int32)))
        return state, drafted[:, :k], jnp.full((b,), k, jnp.int32)


@dataclasses.dataclass(frozen=True)
class DSparkDrafter:
    """The DSpark block drafter (`dspark.py`): its context is, per token, each drafter layer's
    K/V of the projected target features, kept in pages; a block (anchor + k mask slots) attends
    to the context before the anchor (paged, online softmax) and to itself (dense), and the
    two are merged by their log-sum-exps. Drafts are the Markov head's greedy tokens; how many
    a row sends is set by the confidence head (survival >= threshold)."""

    cfg: dspark.DraftConfig
    threshold: float

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    observes_verify = True

    def init_state(self, num_pages: int, page_size: int, dtype: Any) -> PagedKVCache:
        spec = PagedKVSpec(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)
        return PagedKVCache.create(spec, num_pages, page_size, dtype)

    def observe(self, params, state, tokens, positions, tables, last_index, features):
        k_pools, v_pools = list(state.k), list(state.v)
        for pos, tab, feats in zip(positions, tables, features):
            context = dspark.project_context(params, self.cfg, feats)
            for i, (k, v) in enumerate(dspark.context_kv(params, self.cfg, context, jnp.maximum(pos, 0))):
                k_pools[i], v_pools[i] = write_kv(k_pools[i], v_pools[i], k, v, pos, tab)
        return PagedKVCache(k=k_pools, v=v_pools)

    def propose(self, params, state, target_weights, last, positions, tables, budget, k: int):
        cfg = self.cfg
        b, s = last.shape[0], cfg.block_size + 1
        h, kv, e, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        embed = target_weights["embed"]
        x = jnp.concatenate([embed[last][:, None, :],
                             jnp.broadcast_to(params["mask_embed"].astype(embed.dtype), (b, s - 1, d))], axis=1)
        slot_positions = positions[:, None] + jnp.arange(s)
        sees_before = jnp.broadcast_to(jnp.where(budget > 0, positions - 1, -1)[:, None], (b, s))
        no_write = jnp.full((b, s), -1, jnp.int32)
        k_pools, v_pools = list(state.k), list(state.v)
        for i, lw in enumerate(params["layers"]):
            y = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
            q = dspark.rope(cfg, linear(y, lw["wq"]).reshape(b, s, h, e), slot_positions)
            keys = dspark.rope(cfg, linear(y, lw["wk"]).reshape(b, s, kv, e), slot_positions)
            values = linear(y, lw["wv"]).reshape(b, s, kv, e)
            out_ctx, k_pools[i], v_pools[i], lse_ctx = paged_attention(
                q, keys, values, k_pools[i], v_pools[i], no_write, tables, query_positions=sees_before,
                return_lse=True)
            out_blk, lse_blk = _block_attention(q, keys, values)
            w_ctx = jax.nn.sigmoid(lse_ctx - lse_blk)[..., None]  # share of the context's keys
            out = (w_ctx * out_ctx.astype(jnp.float32) + (1 - w_ctx) * out_blk).astype(x.dtype)
            x = x + linear(out.reshape(b, s, h * e), lw["wo"])
            x = x + swiglu(rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps), lw["w_gate"], lw["w_up"], lw["w_down"])
        hidden = rms_norm(x[:, 1:], params["final_norm"], cfg.rms_norm_eps)  # [b, s - 1, d]
        head = target_weights.get("lm_head", embed)
        prev, tokens, confidence = last, [], []
        for j in range(k):  # the Markov head reads the draft before each slot
            logits, conf = dspark.slot_outputs(params, head, hidden[:, j], dspark.markov_features(params, embed, prev))
            prev = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tokens.append(prev)
            confidence.append(conf)
        num = dspark.num_to_verify(jnp.stack(confidence, axis=1), self.threshold)
        return PagedKVCache(k=k_pools, v=v_pools), jnp.stack(tokens, axis=1), num


def _block_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention of q [b, s, h, e] over the block's own k, v [b, s, kv, e], every slot seeing every
    slot. Returns (out f32 [b, s, h, e], log-sum-exp of the scores [b, s, h])."""
    b, s, h, e = q.shape
    kv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, s, kv, h // kv, e) * e ** -0.5
    scores = jnp.einsum("bskge,btke->bskgt", qg, k.astype(jnp.float32))
    lse = jax.nn.logsumexp(scores, axis=-1)
    out = jnp.einsum("bskgt,btke->bskge", jnp.exp(scores - lse[..., None]), v.astype(jnp.float32))
    return out.reshape(b, s, h, e), lse.reshape(b, s, h)
