"""The model runner: turns a scheduler plan into device arrays of bucketed shapes and runs one
jitted program: a prefill (forward over the paged cache, then sampling and logprobs on device;
in a mixed step the running sequences' decode rows ride along as a second group of rows),
or a fused decode of up to `steps` tokens per row in one call (a device loop of forward and
sampling, with a per-row finished mask for EOS, stop token ids and each row's step budget).

Shapes are rounded up to a small set of buckets (powers of two for batch rows and tokens per
row); block tables always have the width of the longest sequence (attention loops only over
the pages in use), so sequences growing never recompile. `num_compiles` counts the distinct
programs this runner has asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weld.engine.sampler import (PenaltyArrays, SamplingArrays, apply_allowed, apply_penalties, ban_tokens, sample,
                                 token_logprobs, unpack_bitmask)
from weld.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from weld.engine.scheduler import MIN_TOKEN_BUCKET, ScheduledSeq, SchedulerOutput, bucket
from weld.engine.sequence import Sequence
from weld.models.common.cache import AttentionBatch, PagedKVCache
from weld.utils.progress import Progress


@dataclasses.dataclass
class StepResult:
    """Host copies of what one call produced, row i for plan entry i, k for the k-th new token."""

    token_ids: np.ndarray  # [n, k] sampled ids; -1 once a row has finished (decode)
    logprobs: np.ndarray | None  # [n, k] raw logprob of the sampled id
    ranks: np.ndarray | None  # [n, k]
    top_ids: np.ndarray | None  # [n, k, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None  # [n, k, MAX_LOGPROBS]
    # Prompt logprobs: for entry i and fed token j, the logprob of the token after it.
    prompt_logprobs: np.ndarray | None = None  # [n, t]
    prompt_ranks: np.ndarray | None = None  # [n, t]
    prompt_top_ids: np.ndarray | None = None  # [n, t, MAX_LOGPROBS]
    prompt_top_logprobs: np.ndarray | None = None  # [n, t, MAX_LOGPROBS]
    # Verify steps, per round: drafts each row sent and how many were accepted (-1: not in that round).
    num_drafts: np.ndarray | None = None  # [n, rounds]
    num_accepted: np.ndarray | None = None  # [n, rounds]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StopArrays:
    """What ends a row inside a fused decode call, besides its step budget."""

    max_steps: jax.Array  # i32 [b]: tokens the row may still produce in this call (0 = padding row)
    num_output: jax.Array  # i32 [b]: tokens the row had produced before this call
    min_tokens: jax.Array  # i32 [b]: EOS and stop ids cannot be sampled before this many tokens
    ignore_eos: jax.Array  # bool [b]
    stop_ids: jax.Array  # i32 [b, s]: the row's stop token ids, padded with -1
    eos_ids: jax.Array  # i32 [e]: the model's end-of-sequence ids

    def banned_ids(self) -> jax.Array:
        """[b, e + s]: the ids min_tokens keeps from being sampled (EOS unless ignore_eos, stop ids)."""
        b = self.stop_ids.shape[0]
        eos = jnp.where(self.ignore_eos[:, None], -1, jnp.broadcast_to(self.eos_ids, (b,) + self.eos_ids.shape))
        return jnp.concatenate([eos, self.stop_ids], axis=1)


def _step(forward, drafter, weights, cache, draft_params, draft_state, tokens, positions, block_tables,
          last_index, sampling, stop, penalties, prompt_targets, token_bitmask, *, cfg, num_top: int,
          with_prompt_logprobs: bool):
    """forward + sample for one padded batch of row groups.

    tokens, positions, block_tables, last_index: tuples with one entry per group; group 0 holds
    prompt chunks [bp, tp], an optional group 1 holds decode rows [bd, 1]. The per-row arrays
    (sampling, stop, penalties) cover the groups' rows in order ([bp + bd]). Prompt logprobs
    (prompt_targets [bp, tp]) are computed for group 0. token_bitmask int32 [bp + bd, ceil(v / 32)]
    (or None: no row is constrained) masks each row's tokens before sampling.
    With a drafter (`weld.engine.spec.drafters`), it observes the same tokens, so its own state
    (same pages, same block tables) covers every computed position too.
    """
    full = tuple(with_prompt_logprobs and g == 0 for g in range(len(tokens)))
    indices = tuple(None if f else li[:, None] for f, li in zip(full, last_index))
    capture = drafter.capture_layers if drafter is not None else ()
    logits, features, cache = forward(weights, cfg, tokens, positions, cache, AttentionBatch(block_tables=block_tables),
                                      indices, capture_layers=capture)
    if drafter is not None:
        draft_state = drafter.observe(draft_params, draft_state, tokens, positions, block_tables, last_index, features)
    last_logits = jnp.concatenate([
        jnp.take_along_axis(lg, li[:, None, None], axis=1)[:, 0] if f else lg[:, 0]
        for lg, li, f in zip(logits, last_index, full)])  # [bp + bd, v]
    prompt = token_logprobs(logits[0], prompt_targets, num_top) if with_prompt_logprobs else None
    scores = last_logits if penalties is None else apply_penalties(last_logits, penalties)
    scores = ban_tokens(scores, stop.banned_ids(), stop.num_output < stop.min_tokens)
    if token_bitmask is not None:
        scores = apply_allowed(scores, unpack_bitmask(token_bitmask, scores.shape[-1]))
    ids = sample(scores, sampling)
    chosen = token_logprobs(last_logits, ids, num_top) if num_top else None
    if chosen is not None:
        chosen = tuple(x[:, None] for x in chosen)  # one new token per row: [b, 1, ...]
    return cache, draft_state, ids[:, None], chosen, prompt


def _verify(forward, drafter, weights, cache, draft_params, draft_state, tokens, positions, num_drafts,
            block_tables, sampling, stop, penalties, token_bitmask, *, cfg, num_top: int, rounds: int):
    """Up to `rounds` speculative rounds in one device call. A round scores each row's last token
    and its drafts in one forward and accepts or rejects them on device
    (`weld.engine.spec.acceptance.rejection_accept`: greedy rows keep the prefix equal to the
    target's argmax, sampled rows are verified by exact rejection sampling, so the output is
    distributed exactly as without speculation).

    tokens [b, k+1]: each row's last token (not yet in the cache), then its drafts from a host
    proposer (n-gram; then rounds is 1), ignored past num_drafts [b]. With a device drafter (a
    draft model, the DSpark drafter), each round's drafts are its greedy tokens, made here, and
    a row sends at most as many as both num_drafts and the drafter allow. positions [b]: the
    last token's position. stop.max_steps [b]: tokens the row may produce in this call (its
    pages hold that many slots); a round never feeds a row past them.
    A row with no drafts takes a plain decode step. Rejected slots leave K/V past the row's new
    length; they are never read before being overwritten (every forward writes before it reads).
    A row ends on EOS, a stop id or its budget, as in the fused decode; tokens after its end
    are dropped. Penalties and grammar masks apply to slot 0 (rows using them send no drafts;
    a grammar row has a budget of 1), min_tokens bans EOS and stop ids in every slot before
    the row's minimum.
    Returns the caches, the emitted ids [b, rounds * (k+1)] (each row's tokens in order, then
    -1), their raw logprobs, and per round the drafts each row sent and how many were accepted
    ([b, rounds] each; -1 where the row did not take part).
    """
    from weld.engine.spec.acceptance import rejection_accept

    b, s = tokens.shape
    width = rounds * s
    batch = AttentionBatch(block_tables=block_tables)
    banned = stop.banned_ids()
    first_allowed = None if token_bitmask is None else unpack_bitmask(token_bitmask, cfg.vocab_size)
    slot = jnp.arange(s, dtype=jnp.int32)[None, :]
    rows = jnp.arange(b)[:, None]
    capture = drafter.capture_layers if drafter is not None and drafter.observes_verify else ()
    out_lp = (jnp.zeros((b, width), jnp.float32), jnp.zeros((b, width), jnp.int32),
              jnp.zeros((b, width, num_top), jnp.int32), jnp.zeros((b, width, num_top), jnp.float32))
    history = (jnp.full((b, rounds), -1, jnp.int32), jnp.full((b, rounds), -1, jnp.int32))

    def cond(carry):
        r, done = carry[0], carry[4]
        return (r < rounds) & ~jnp.all(done)

    def body(carry):
        r, cache, draft_state, last, done, made, out_ids, out_lp, history, pen = carry
        live = ~done
        budget = jnp.where(live, stop.max_steps - made, 0)  # slots the row still owns
        pos = positions + made
        feed = tokens
        sent = num_drafts  # the most each row may send per round (host drafts: one round only)
        if drafter is not None:
            draft_state, drafted, wanted = drafter.propose(draft_params, draft_state, weights, last, pos,
                                                           block_tables, budget, s - 1)
            feed = jnp.concatenate([last[:, None], drafted], axis=1)
            sent = jnp.minimum(sent, wanted)
        else:
            feed = feed.at[:, 0].set(last)
        sent = jnp.where(live, jnp.clip(jnp.minimum(sent, budget - 1), 0, s - 1), 0)
        fed_positions = jnp.where(live[:, None] & (slot <= sent[:, None]), pos[:, None] + slot, -1)
        logits, features, cache = forward(weights, cfg, feed, fed_positions, cache, batch,
                                          **({"capture_layers": capture} if capture else {}))
        if capture:
            draft_state = drafter.observe(draft_params, draft_state, (feed,), (fed_positions,), (block_tables,),
                                          (jnp.zeros((b,), jnp.int32),), (features,))
        v = logits.shape[-1]
        scores = logits
        if pen is not None:
            scores = scores.at[:, 0].set(apply_penalties(scores[:, 0], pen))
        num_out = stop.num_output + made
        ban = (num_out[:, None] + slot) < stop.min_tokens[:, None]
        scores = ban_tokens(scores.reshape(b * s, v), jnp.repeat(banned, s, axis=0), ban.reshape(-1)).reshape(b, s, v)
        if first_allowed is not None:
            scores = scores.at[:, 0].set(apply_allowed(scores[:, 0], first_allowed | (r > 0)))
        accepted, emitted = rejection_accept(scores, feed[:, 1:], sent,
                                             dataclasses.replace(sampling, position=pos + 1))
        # Where the row ends: the first EOS / stop id (once min_tokens is met), or its budget.
        count = jnp.minimum(accepted + 1, budget)
        is_stop = ((jnp.isin(emitted, stop.eos_ids) & ~stop.ignore_eos[:, None])
                   | jnp.any(emitted[:, :, None] == stop.stop_ids[:, None, :], axis=-1))
        is_stop &= (num_out[:, None] + slot + 1 > stop.min_tokens[:, None]) & (slot < count[:, None])
        first_stop = jnp.min(jnp.where(is_stop, slot, s), axis=1)
        count = jnp.where(live, jnp.minimum(count, first_stop + 1), 0)
        keep = slot < count[:, None]
        target = jnp.where(keep, made[:, None] + slot, width)  # out of bounds: dropped
        out_ids = out_ids.at[rows, target].set(emitted, mode="drop")
        if num_top:
            chosen = token_logprobs(logits, jnp.maximum(emitted, 0), num_top)
            out_lp = tuple(buf.at[rows, target].set(x, mode="drop") for buf, x in zip(out_lp, chosen))
        if pen is not None:
            ids = jnp.where(keep, emitted, v)
            pen = dataclasses.replace(pen, counts=pen.counts.at[rows, ids].add(1, mode="drop"))
        history = (history[0].at[:, r].set(jnp.where(live, sent, -1)),
                   history[1].at[:, r].set(jnp.where(live, jnp.minimum(accepted, sent), -1)))
        last = jnp.where(live, jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0], last)
        made = made + count
        done = done | (first_stop < count) | (made >= stop.max_steps)
        return r + 1, cache, draft_state, last, done, made, out_ids, out_lp, history, pen

    carry = (jnp.int32(0), cache, draft_state, tokens[:, 0], stop.max_steps <= 0, jnp.zeros((b,), jnp.int32),
             jnp.full((b, width), -1, jnp.int32), out_lp, history, penalties)
    _, cache, draft_state, _, _, _, out_ids, out_lp, history, _ = jax.lax.while_loop(cond, body, carry)
    return cache, draft_state, out_ids, (out_lp if num_top else None), history


def _decode(forward, weights, cache, tokens, positions, block_tables, sampling, stop, penalties, token_bitmask, *,
            cfg, steps: int, num_top: int):
    """Up to `steps` decode steps in one device call.

    tokens, positions [b]: each row's last token (not yet in the cache) and its position.
    Each step feeds one token per live row, samples the next (key from the row's seed and the
    new position, so results do not depend on how steps are grouped into calls), and marks the
    row finished on EOS, a stop id or its step budget; a finished row feeds padding (writes
    nothing) for the rest of the call, and the loop ends early when every row has finished.
    token_bitmask int32 [b, ceil(v / 32)] (or None) masks the first step only: a constrained
    row has a step budget of 1 (its next mask is computed on the host).
    Returns the cache and the new ids [b, steps] (-1 after a row finished), with logprobs.
    """
    b = tokens.shape[0]
    batch = AttentionBatch(block_tables=block_tables)
    banned = stop.banned_ids()
    first_allowed = None if token_bitmask is None else unpack_bitmask(token_bitmask, cfg.vocab_size)  # [b, v]
    done = stop.max_steps <= 0
    out_ids = jnp.full((b, steps), -1, jnp.int32)
    out_lp = (jnp.zeros((b, steps), jnp.float32), jnp.zeros((b, steps), jnp.int32),
              jnp.zeros((b, steps, num_top), jnp.int32), jnp.zeros((b, steps, num_top), jnp.float32))

    def cond(carry):
        i, done = carry[0], carry[4]
        return (i < steps) & ~jnp.all(done)

    def body(carry):
        i, cache, tok, pos, done, num_out, out_ids, out_lp, pen = carry
        live = ~done
        feed_pos = jnp.where(live, pos, -1)
        logits, _, cache = forward(weights, cfg, tok[:, None], feed_pos[:, None], cache, batch,
                                   jnp.zeros((b, 1), jnp.int32))
        logits = logits[:, 0]  # [b, v]
        scores = logits if pen is None else apply_penalties(logits, pen)
        allowed = ban_tokens(scores, banned, num_out < stop.min_tokens)
        if first_allowed is not None:
            allowed = apply_allowed(allowed, first_allowed | (i > 0))
        new = sample(allowed, dataclasses.replace(sampling, position=pos + 1))
        ended = (jnp.isin(new, stop.eos_ids) & ~stop.ignore_eos) | jnp.any(new[:, None] == stop.stop_ids, axis=-1)
        ended = (ended & (num_out >= stop.min_tokens)) | (i + 1 >= stop.max_steps)
        num_out = num_out + live
        out_ids = out_ids.at[:, i].set(jnp.where(live, new, -1))
        if num_top:
            chosen = token_logprobs(logits, new, num_top)
            out_lp = tuple(buf.at[:, i].set(x) for buf, x in zip(out_lp, chosen))
        if pen is not None:
            pen = dataclasses.replace(pen, counts=pen.counts.at[jnp.arange(b), new].add(live.astype(jnp.int32)))
        tok = jnp.where(live, new, tok)
        pos = jnp.where(live, pos + 1, pos)
        return i + 1, cache, tok, pos, done | (live & ended), num_out, out_ids, out_lp, pen

    carry = (jnp.int32(0), cache, tokens, positions, done, stop.num_output, out_ids, out_lp, penalties)
    _, cache, _, _, _, _, out_ids, out_lp, _ = jax.lax.while_loop(cond, body, carry)
    return cache, out_ids, (out_lp if num_top else None), None


BACKENDS = ("xla", "megakernel")


def decode_forward(family: ModuleType, cfg: Any, backend: str):
    """The forward the fused decode loop calls: the family's XLA forward, or the dense family's
    TPU megakernel (interpret mode off a TPU). Prefill and mixed steps always run on XLA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return family.forward
    from weld.models import megakernel

    megakernel.check_supported(cfg)
    return megakernel.forward


class ModelRunner:
    """Owns the weights, the KV page pools and the jitted step program."""

    def __init__(self, family: ModuleType, cfg: Any, weights: Any, *, num_pages: int, page_size: int,
                 kv_dtype: Any, max_model_len: int, steps_per_call: int = 8, eos_token_ids: tuple[int, ...] = (),
                 backend: str = "xla", drafter: Any = None, draft_params: Any = None, num_spec_tokens: int = 0,
                 spec_rounds: int = 1):
        """drafter: a device drafter (`weld.engine.spec.drafters`) with its weights draft_params,
        or None; its state gets pools of its own over the same pages, so block tables serve both."""
        self.family = family
        self.cfg = cfg
        self.weights = weights
        self.page_size = page_size
        self.max_pages_per_seq = bucket(-(-max_model_len // page_size), 8)
        self.cache = PagedKVCache.create(cfg.kv_spec, num_pages, page_size, kv_dtype)
        self.drafter = drafter
        self.draft_params = draft_params
        self.draft_state = drafter.init_state(num_pages, page_size, kv_dtype) if drafter is not None else None
        self.num_spec_tokens = num_spec_tokens
        self.spec_rounds = spec_rounds  # speculative rounds per device call (host drafts: 1)
        self._programs: set[tuple] = set()
        self.steps_per_call = steps_per_call
        self.eos_token_ids = np.asarray(sorted(set(eos_token_ids)) or [-1], np.int32)
        self._step = jax.jit(functools.partial(_step, family.forward, drafter),
                             static_argnames=("cfg", "num_top", "with_prompt_logprobs"),
                             donate_argnames=("cache", "draft_state"))
        # The verification block runs where decode runs: XLA, or the megakernel's verify variant.
        self._verify = jax.jit(functools.partial(_verify, decode_forward(family, cfg, backend), drafter),
                               static_argnames=("cfg", "num_top", "rounds"), donate_argnames=("cache", "draft_state"))
        self._decode = jax.jit(functools.partial(_decode, decode_forward(family, cfg, backend)),
                               static_argnames=("cfg", "steps", "num_top"), donate_argnames=("cache",))

    @property
    def num_compiles(self) -> int:
        """Distinct program shapes requested so far (each compiled once)."""
        return len(self._programs)

    def execute(self, plan: SchedulerOutput, want_logprobs: bool = False,
                want_prompt_logprobs: bool = False, token_bitmask: np.ndarray | None = None,
                drafts: np.ndarray | None = None, num_drafts: np.ndarray | None = None) -> StepResult:
        """Runs `plan`. token_bitmask int32 [len(plan.entries), ceil(vocab / 32)], row i for entry i
        (all bits set: unconstrained), or None when no entry is constrained.
        A "verify" plan takes each entry's drafts (int32 [n, num_spec_tokens], padded) and how
        many to verify (num_drafts [n]); with a draft model only num_drafts counts."""
        entries = plan.entries
        n = len(entries)
        num_top = MAX_LOGPROBS if want_logprobs or want_prompt_logprobs else 0
        if plan.kind in ("decode", "verify"):
            b = bucket(n)
            rows = list(range(n))
        else:  # prompt chunks in rows [0, bp), decode rows (mixed) in [bp, bp + bd)
            bp, num_decode = bucket(plan.num_prefill), n - plan.num_prefill
            b = bp + (bucket(num_decode) if num_decode else 0)
            rows = list(range(plan.num_prefill)) + [bp + j for j in range(num_decode)]
        block_tables = np.zeros((b, self.max_pages_per_seq), np.int32)
        for r, e in zip(rows, entries):
            block_tables[r, :len(e.seq.block_table)] = e.seq.block_table
        sampling = _sampling_arrays(entries, rows, b)
        stop = self._stop_arrays(entries, rows, b)
        penalties = _penalty_arrays(entries, rows, b, self.cfg.vocab_size)
        bitmask = self._bitmask_rows(token_bitmask, rows, b)
        history = None
        if plan.kind == "decode":
            cache, ids, chosen, prompt = self._run_decode(entries, b, block_tables, sampling, stop, penalties,
                                                          num_top, bitmask)
        elif plan.kind == "verify":
            cache, self.draft_state, ids, chosen, history = self._run_verify(
                entries, b, block_tables, sampling, stop, penalties, num_top, bitmask, drafts, num_drafts)
            prompt = None
        else:
            cache, self.draft_state, ids, chosen, prompt = self._run_prefill(
                plan, bp, block_tables, sampling, stop, penalties, num_top, want_prompt_logprobs, bitmask)
        self.cache = cache
        ids, chosen, prompt, history = jax.device_get((ids, chosen, prompt, history))
        rows = np.asarray(rows)
        result = StepResult(token_ids=ids[rows], logprobs=None, ranks=None, top_ids=None, top_logprobs=None)
        if chosen is not None:
            result.logprobs, result.ranks, result.top_ids, result.top_logprobs = (x[rows] for x in chosen)
        if history is not None:
            result.num_drafts, result.num_accepted = (x[rows] for x in history)
        if prompt is not None:  # prompt chunks only: entry i < num_prefill is row i
            (result.prompt_logprobs, result.prompt_ranks, result.prompt_top_ids,
             result.prompt_top_logprobs) = (x[:plan.num_prefill] for x in prompt)
        return result

    def _bitmask_rows(self, token_bitmask: np.ndarray | None, rows: list[int], b: int) -> jax.Array | None:
        """The entries' bitmask rows placed at their batch rows [b, w]; padding rows allow everything."""
        if token_bitmask is None:
            return None
        width = -(-self.cfg.vocab_size // 32)
        if token_bitmask.shape != (len(rows), width) or token_bitmask.dtype != np.int32:
            raise ValueError(f"token_bitmask must be int32 [{len(rows)}, {width}], "
                             f"got {token_bitmask.dtype} {token_bitmask.shape}")
        out = np.full((b, width), -1, np.int32)
        out[np.asarray(rows)] = token_bitmask
        return jnp.asarray(out)

    def _run_prefill(self, plan, bp, block_tables, sampling, stop, penalties, num_top, want_prompt_logprobs,
                     bitmask):
        chunks, decodes = plan.entries[:plan.num_prefill], plan.entries[plan.num_prefill:]
        t = bucket(max(e.num_tokens for e in chunks), MIN_TOKEN_BUCKET)
        tokens = np.zeros((bp, t), np.int32)
        positions = np.full((bp, t), -1, np.int32)
        last_index = np.zeros((bp,), np.int32)
        targets = np.zeros((bp, t), np.int32)
        for i, e in enumerate(chunks):
            seq = e.seq
            tokens[i, :e.num_tokens] = _tokens_of(e)
            positions[i, :e.num_tokens] = np.arange(e.start, e.start + e.num_tokens)
            last_index[i] = e.num_tokens - 1
            if want_prompt_logprobs:
                # The target of fed token j is the token after it, where that is known.
                targets[i, :e.num_tokens] = [seq.token_at(pos + 1) if pos + 1 < seq.num_tokens else 0
                                             for pos in range(e.start, e.start + e.num_tokens)]
        groups = [(tokens, positions, block_tables[:bp], last_index)]
        bd = block_tables.shape[0] - bp
        if bd:  # decode rows of a mixed step: one token each, at the end of the batch
            d_tokens = np.zeros((bd, 1), np.int32)
            d_positions = np.full((bd, 1), -1, np.int32)
            for j, e in enumerate(decodes):
                d_tokens[j, 0] = e.seq.token_at(e.start)
                d_positions[j, 0] = e.start
            groups.append((d_tokens, d_positions, block_tables[bp:], np.zeros((bd,), np.int32)))
        self._programs.add(("prefill", bp, t, bd, stop.stop_ids.shape[1], _penalty_key(penalties), num_top,
                            want_prompt_logprobs, bitmask is not None))
        tokens, positions, tables, last = (tuple(jnp.asarray(g[k]) for g in groups) for k in range(4))
        return self._step(self.weights, self.cache, self.draft_params, self.draft_state, tokens, positions, tables,
                          last, sampling, stop, penalties, jnp.asarray(targets), bitmask, cfg=self.cfg,
                          num_top=num_top, with_prompt_logprobs=want_prompt_logprobs)

    def _run_verify(self, entries, b, block_tables, sampling, stop, penalties, num_top, bitmask, drafts, num_drafts):
        k = self.num_spec_tokens
        tokens = np.zeros((b, k + 1), np.int32)
        positions = np.zeros((b,), np.int32)
        sent = np.zeros((b,), np.int32)
        for i, e in enumerate(entries):
            tokens[i, 0] = e.seq.token_at(e.start)
            positions[i] = e.start
            sent[i] = min(int(num_drafts[i]) if num_drafts is not None else 0, k)
            if drafts is not None and self.drafter is None:
                tokens[i, 1:1 + sent[i]] = drafts[i, :sent[i]]
        rounds = self.spec_rounds
        self._programs.add(("verify", b, k, rounds, stop.stop_ids.shape[1], _penalty_key(penalties), num_top,
                            bitmask is not None))
        return self._verify(self.weights, self.cache, self.draft_params, self.draft_state, jnp.asarray(tokens),
                            jnp.asarray(positions), jnp.asarray(sent), jnp.asarray(block_tables), sampling, stop,
                            penalties, bitmask, cfg=self.cfg, num_top=num_top, rounds=rounds)

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, progress: bool | None = None) -> int:
        """Compiles every program shape the scheduler can ask for under these limits (with default
        sampling: no logprobs, penalties or extra stop ids, which add variants of their own).
        Runs each once on dummy sequences; call it before any request is running, since the
        dummies write into free pages. Returns the number of programs compiled.
        """
        plans = warmup_plans(max_num_seqs, max_num_batched_tokens, self.page_size, self.num_spec_tokens > 0)
        before = self.num_compiles
        with Progress(len(plans), "Compiling", unit="program", enabled=progress) as bar:
            for plan in plans:
                self.execute(plan)
                bar.update(1)
        return self.num_compiles - before

    def _stop_arrays(self, entries: list[ScheduledSeq], rows: list[int], b: int) -> StopArrays:
        max_steps = np.zeros((b,), np.int32)
        num_output = np.zeros((b,), np.int32)
        min_tokens = np.zeros((b,), np.int32)
        ignore_eos = np.zeros((b,), bool)
        s = bucket(max(len(e.seq.params.stop_token_ids) for e in entries))
        stop_ids = np.full((b, s), -1, np.int32)
        for i, e in zip(rows, entries):
            p = e.seq.params
            max_steps[i] = e.max_steps if e.sample else 0
            num_output[i] = e.seq.num_output_tokens
            min_tokens[i] = p.min_tokens
            ignore_eos[i] = p.ignore_eos
            stop_ids[i, :len(p.stop_token_ids)] = p.stop_token_ids
        return StopArrays(jnp.asarray(max_steps), jnp.asarray(num_output), jnp.asarray(min_tokens),
                          jnp.asarray(ignore_eos), jnp.asarray(stop_ids), jnp.asarray(self.eos_token_ids))

    def _run_decode(self, entries, b, block_tables, sampling, stop, penalties, num_top, bitmask):
        tokens = np.zeros((b,), np.int32)
        positions = np.zeros((b,), np.int32)
        for i, e in enumerate(entries):
            tokens[i] = e.seq.token_at(e.start)
            positions[i] = e.start
        steps = self.steps_per_call
        self._programs.add(("decode", b, stop.stop_ids.shape[1], _penalty_key(penalties), steps, num_top,
                            bitmask is not None))
        return self._decode(self.weights, self.cache, jnp.asarray(tokens), jnp.asarray(positions),
                            jnp.asarray(block_tables), sampling, stop, penalties, bitmask, cfg=self.cfg, steps=steps,
                            num_top=num_top)


def warmup_plans(max_num_seqs: int, max_num_batched_tokens: int, page_size: int,
                 speculative: bool = False) -> list[SchedulerOutput]:
    """One dummy plan per bucketed shape the scheduler can produce: fused decodes (or, with
    `speculative`, verification steps) of bd rows,
    and prefills of bp rows x tp tokens with bd decode rows riding along (bd = 0: none).

    A shape is feasible when its smallest content fits the limits (a bucket of n > 1 holds at
    least n/2 + 1 items, a token bucket tp > 16 a chunk of at least tp/2 + 1 tokens) and, with
    several prompt rows longer than the minimal bucket, bp * tp stays within the scheduler's
    padded-slot limit.
    """
    def least_rows(n: int) -> int:
        return n if n <= 1 else n // 2 + 1

    params = SamplingParams(max_tokens=1, temperature=0)
    row_buckets = [1 << i for i in range(bucket(max_num_seqs).bit_length())]
    slots = bucket(max_num_batched_tokens, MIN_TOKEN_BUCKET)
    token_buckets = [1 << i for i in range(MIN_TOKEN_BUCKET.bit_length() - 1, slots.bit_length())]

    def dummy(num_tokens: int, chunk: int, decode: bool) -> ScheduledSeq:
        seq = Sequence("warmup", [0] * num_tokens, params)
        seq.block_table = list(range(-(-num_tokens // page_size)))
        if decode:
            return ScheduledSeq(seq, num_tokens - 1, 1, sample=True, max_steps=1)
        return ScheduledSeq(seq, 0, chunk, sample=True)

    kind = "verify" if speculative else "decode"
    plans = [SchedulerOutput(kind, [dummy(2, 1, True) for _ in range(least_rows(bd))]) for bd in row_buckets]
    for tp in token_buckets:
        for bp in row_buckets:
            for bd in [0] + row_buckets:
                rows_p, rows_d = least_rows(bp), least_rows(bd)
                chunk = 1 if tp == MIN_TOKEN_BUCKET else tp // 2 + 1
                if (rows_p + rows_d > max_num_seqs or chunk + rows_p - 1 + rows_d > max_num_batched_tokens
                        or (rows_p > 1 and tp > MIN_TOKEN_BUCKET and bp * tp > slots)):
                    continue
                chunks = [dummy(chunk, chunk, False)] + [dummy(1, 1, False) for _ in range(rows_p - 1)]
                decodes = [dummy(2, 1, True) for _ in range(rows_d)]
                plans.append(SchedulerOutput("mixed" if decodes else "prefill", chunks + decodes, len(chunks)))
    return plans


def _penalty_arrays(entries: list[ScheduledSeq], rows: list[int], b: int, vocab_size: int) -> PenaltyArrays | None:
    """Penalty inputs, or None when no row uses any (then the programs skip them entirely)."""
    if not any(e.seq.params.penalized for e in entries):
        return None
    presence = np.zeros((b,), np.float32)
    frequency = np.zeros((b,), np.float32)
    repetition = np.ones((b,), np.float32)
    counts = np.zeros((b, vocab_size), np.int32)
    prompt_mask = np.zeros((b, vocab_size), bool)
    m = bucket(max(len(e.seq.params.logit_bias or {}) for e in entries))
    bias_ids = np.full((b, m), -1, np.int32)
    bias_values = np.zeros((b, m), np.float32)
    for i, e in zip(rows, entries):
        p, seq = e.seq.params, e.seq
        if not p.penalized:
            continue
        presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        if seq.output_token_ids:
            counts[i] = np.bincount(np.asarray(seq.output_token_ids), minlength=vocab_size)[:vocab_size]
        prompt_mask[i, np.asarray(seq.prompt_token_ids)] = True
        for j, (token, value) in enumerate((p.logit_bias or {}).items()):
            bias_ids[i, j], bias_values[i, j] = token, value
    return PenaltyArrays(jnp.asarray(presence), jnp.asarray(frequency), jnp.asarray(repetition), jnp.asarray(counts),
                         jnp.asarray(prompt_mask), jnp.asarray(bias_ids), jnp.asarray(bias_values))


def _penalty_key(penalties: PenaltyArrays | None) -> int:
    return -1 if penalties is None else penalties.bias_ids.shape[1]


def _sampling_arrays(entries: list[ScheduledSeq], rows: list[int], b: int) -> SamplingArrays:
    """Per-row sampling parameters; `position` is that of the first token sampled this call."""
    temperature = np.zeros((b,), np.float32)
    top_k = np.zeros((b,), np.int32)
    top_p = np.ones((b,), np.float32)
    min_p = np.zeros((b,), np.float32)
    seed_hi = np.zeros((b,), np.uint32)
    seed_lo = np.zeros((b,), np.uint32)
    position = np.zeros((b,), np.int32)
    for i, e in zip(rows, entries):
        seq, p = e.seq, e.seq.params
        temperature[i] = 0.0 if p.greedy else p.temperature
        top_k[i] = max(p.top_k, 0)
        top_p[i] = p.top_p
        min_p[i] = p.min_p
        seed_hi[i] = (seq.seed >> 32) & 0xFFFFFFFF
        seed_lo[i] = seq.seed & 0xFFFFFFFF
        position[i] = e.start + e.num_tokens
    return SamplingArrays(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p),
                          jnp.asarray(seed_hi), jnp.asarray(seed_lo), jnp.asarray(position))


def _tokens_of(entry: ScheduledSeq) -> list[int]:
    seq = entry.seq
    all_ids = seq.prompt_token_ids + seq.output_token_ids
    return all_ids[entry.start:entry.start + entry.num_tokens]
