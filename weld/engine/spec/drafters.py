"""Device-side drafters for the runner: n-gram lookup, a separate draft model, and the DSpark
block drafter. Each drafts inside the verification loop, so one device call runs several
propose -> verify -> accept rounds.

The model drafters keep per-token state in page pools of their own, indexed by the target's
block tables (same page size, same page count): a position's state lives where the target's K/V
for it lives, so a sequence's pages, prefix-cache hits, rollback by length and freeing serve
both at once. Rejected slots leave stale state past a row's length, overwritten before anything
reads it (as the target's K/V). n-gram lookup keeps no state: it reads each row's token history,
which the host sends with the call and the loop extends with every accepted token.

A drafter is a static object (hashable, closed over by the jitted programs) with:
  capture_layers           target layers whose residual streams `observe` needs (() = none)
  cache_spec() -> CacheSpec | None   its per-token state, created by the runner over the target's
      pages (None: no state)
  observe(params, state, tokens, positions, tables, last_index, features) -> state
      after every target forward over row groups (tuples of [b, t] arrays; features: the target's
      captured streams per group); keeps the drafter's state in step with the target's cache.
  propose(params, state, target_weights, last, positions, tables, budget, k, history) -> (state, drafts, num)
      last [b]: each row's last token at positions [b]; budget [b]: slots the row owns from
      there (drafting writes state only within them); history: each row's tokens by position
      [b, w] (the last one included) when `uses_history`, else None. Greedy drafts [b, k]
      (deterministic: verify with draft_probs=None) and how many the drafter would send [b].
  observes_verify: whether `observe` must also see the verification forward.
  uses_history: whether `propose` reads the rows' token histories.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from weld.engine.sampler import argmax
from weld.engine.spec import dspark, ngram
from weld.models.common.attention import dense_attention, paged_attention, write_kv
from weld.models.common.cache import AttentionBatch, Cache, CacheSpec, PagedKV
from weld.models.common.layers import linear, rms_norm


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup (`ngram.lookup`): the tokens that followed the most recent earlier occurrence
    of the row's last min_n..max_n tokens. No weights, no state."""

    min_n: int = 1
    max_n: int = 3
    capture_layers: tuple[int, ...] = ()
    observes_verify: bool = False
    uses_history: bool = True

    def cache_spec(self) -> None:
        return None

    def observe(self, params, state, tokens, positions, tables, last_index, features):
        return state

    def propose(self, params, state, target_weights, last, positions, tables, budget, k: int, history=None):
        drafts, num = ngram.lookup(history, positions + 1, k, self.min_n, self.max_n)
        return state, drafts, num


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """A smaller model with the target's tokenizer drafts greedily, one token per forward."""

    family: Any  # the draft model's family module (forward, Config)
    cfg: Any
    capture_layers: tuple[int, ...] = ()
    observes_verify: bool = False  # propose already fed every slot the target may keep
    uses_history: bool = False

    def cache_spec(self) -> CacheSpec:
        return self.family.cache_spec(self.cfg)

    def observe(self, params, state, tokens, positions, tables, last_index, features):
        _, _, state = self.family.forward(params, self.cfg, tokens, positions, state,
                                          AttentionBatch(block_tables=tables),
                                          tuple(li[:, None] for li in last_index))
        return state

    def propose(self, params, state, target_weights, last, positions, tables, budget, k: int, history=None):
        """Feeds the last token and k drafts (k + 1 forwards), so the draft cache covers every
        slot the target may accept, the bonus token's predecessor included."""
        b = last.shape[0]
        batch = AttentionBatch(block_tables=tables)

        def step(j, carry):
            state, tok, drafted = carry
            pos = jnp.where(j < budget, positions + j, -1)[:, None]  # only the row's own slots
            logits, _, state = self.family.forward(params, self.cfg, tok[:, None], pos, state, batch,
                                                   jnp.zeros((b, 1), jnp.int32))
            tok = argmax(logits[:, 0])
            return state, tok, drafted.at[:, j].set(tok)

        state, _, drafted = jax.lax.fori_loop(0, k + 1, step, (state, last, jnp.zeros((b, k + 1), jnp.int32)))
        return state, drafted[:, :k], jnp.full((b,), k, jnp.int32)


@dataclasses.dataclass(frozen=True)
class DSparkDrafter:
    """The DSpark block drafter (`dspark.py`): its context is, per token, each drafter layer's
    K/V of the projected target features, kept in pages; a block (anchor + k mask slots) attends
    to the context before the anchor (paged, online softmax) and to itself (dense), and the
    two are merged by their log-sum-exps. Drafts are the Markov head's greedy tokens; how many
    a row sends is set by the confidence head (survival >= threshold).

    A call of width k < block_size drafts with a block of k slots: the anchor and the slots it
    may send, not block_size mask slots of which the last are never read. The block's slots see
    each other, so the trailing slots do touch the first ones' hidden states, but barely: on
    chat.txt at batch 1 the shipped drafter (block 7) had 401 of 709 drafts accepted at k = 1
    with a block of 1, 400 of 708 with its whole block, and 480 / 481 of 1,076 at k = 3. A
    block's layers cost its rows, compute-bound from a few rows on up (batch 4 on the EPYC
    host: a block of 8 slots a row took 0.28x a decode step at k = 1)."""

    cfg: dspark.DraftConfig
    threshold: float

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    observes_verify = True
    uses_history = False

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(tuple(PagedKV(self.cfg.num_kv_heads, self.cfg.head_dim) for _ in range(self.cfg.num_layers)))

    def observe(self, params, state, tokens, positions, tables, last_index, features):
        pages = list(state.layers)
        for pos, tab, feats in zip(positions, tables, features):
            context = dspark.project_context(params, self.cfg, feats)
            for i, (k, v) in enumerate(dspark.context_kv(params, self.cfg, context, jnp.maximum(pos, 0))):
                k_pages, v_pages = write_kv(pages[i].k, pages[i].v, k, v, pos, tab)
                pages[i] = dataclasses.replace(pages[i], k=k_pages, v=v_pages)
        return Cache(layers=pages)

    def propose(self, params, state, target_weights, last, positions, tables, budget, k: int, history=None):
        cfg = self.cfg
        if not 1 <= k <= cfg.block_size:
            raise ValueError(f"a DSpark drafter with a block of {cfg.block_size} drafts 1 to {cfg.block_size} "
                             f"tokens a round, not {k}")
        b, s, d = last.shape[0], k + 1, cfg.hidden_size  # the anchor and the k slots drafted
        embed = target_weights["embed"]
        x = jnp.concatenate([embed[last][:, None, :],
                             jnp.broadcast_to(params["mask_embed"].astype(embed.dtype), (b, s - 1, d))], axis=1)
        slot_positions = positions[:, None] + jnp.arange(s)
        sees_before = jnp.where(budget > 0, positions - 1, -1)[:, None]
        pages = state.layers
        last_layer = len(params["layers"]) - 1
        for i, lw in enumerate(params["layers"]):
            def attend(q, keys, values, i=i):
                m = q.shape[1]  # the slots whose outputs are read
                # The context's pools are read, not written: the block passes no K/V (zero tokens).
                # A write of its slots at position -1 wrote nothing but still ran a scatter over
                # each pool (~0.08 ms a round at batch 1 on the EPYC host, 2.5% of a decode step).
                out_ctx, _, _, lse_ctx = paged_attention(
                    q, keys[:, :0], values[:, :0], pages[i].k, pages[i].v, jnp.zeros((b, 0), jnp.int32), tables,
                    query_positions=jnp.broadcast_to(sees_before, (b, m)), return_lse=True)
                out_blk, lse_blk = dense_attention(q, keys, values, jnp.ones((1, m, s), bool))  # slots see each other
                w_ctx = jax.nn.sigmoid(lse_ctx - lse_blk)[..., None]  # share of the context's keys
                return w_ctx * out_ctx.astype(jnp.float32) + (1 - w_ctx) * out_blk

            # the last layer computes only the k slots whose hidden states are read
            x = dspark.layer(cfg, lw, x, slot_positions, attend, slice(1, k + 1) if i == last_layer else slice(None))
        hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)  # [b, k, d]

        def drafts(hidden):
            head_logits = linear(hidden, dspark.draft_head(params, target_weights))  # [b, k, n]: once per block
            prev, tokens, confidence = last, [], []
            for j in range(k):  # the Markov head reads the draft before each slot
                logits, conf = dspark.slot_outputs(params, head_logits[:, j], hidden[:, j],
                                                   dspark.markov_features(params, embed, prev))
                prev = dspark.draft_ids(params, argmax(logits))
                tokens.append(prev)
                confidence.append(conf)
            return jnp.stack(tokens, axis=1), dspark.num_to_verify(jnp.stack(confidence, axis=1), self.threshold)

        # A row sends nothing unless its first slot's confidence (which reads neither the head nor
        # the Markov loop) reaches the threshold: when no row's does, the block costs its layers only.
        first = dspark.confidence(params, hidden[:, 0], dspark.markov_features(params, embed, last))
        tokens, num = jax.lax.cond(jnp.any(first >= self.threshold), drafts,
                                   lambda _: (jnp.zeros((b, k), jnp.int32), jnp.zeros((b,), jnp.int32)), hidden)
        return state, tokens, num
