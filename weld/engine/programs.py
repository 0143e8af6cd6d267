"""The device programs: prefill (chunked, mixed with decode rows), the fused decode loop and
speculative verification. Each is jitted once per bucketed shape by the runner; the cache and a
drafter's state are donated.

They share one rule for what the next token may be (`constrain`: penalties, min_tokens' ban
on EOS and stop ids, a grammar's mask) and one rule for where a row ends (`stop_hit`: EOS unless
ignore_eos, or a stop id, once min_tokens are out), and they report per row whether its last
token ended it (`stopped`), so the host never re-derives it.

Streaming: the decode and verify loops hand the host what they have produced so far every
stream[0] steps (rounds) through `sink` (`hand_over`), so a streamed token reaches its client
when it is sampled, not when the call ends.

Conventions: b rows; v the vocabulary; ids -1 mark "no token" (padding, or after a row ended).
state_slots: each row's recurrent-state slot ([b], -1: none; in a prefill, a tuple with one
entry per row group), or None for a model without linear-attention layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from weld.engine.batch import PenaltyArrays, SamplingArrays, StopArrays
from weld.engine.sampler import (all_finite, apply_allowed, apply_penalties, ban_tokens, sample, token_logprobs,
                                 unpack_bitmask)
from weld.models.common.cache import AttentionBatch


# A row's token where its logits held a NaN or an inf (a numerical fault, in the weights or the
# hardware): the row ends there, and the host ends that request with an error, not its neighbours.
NONFINITE = -2


def one_of(pred: jax.Array, if_true: Callable, if_false: Callable | None, cache: Any) -> tuple[Any, Any]:
    """if_true(cache) where pred, else if_false(cache) (None: the cache as it is, aux zeros); each
    returns (cache, aux) with the same shapes. Two while loops of at most one trip each rather
    than `lax.cond`: XLA updates a loop's carry in place, where a cond over the donated cache
    copied every pool into its branch (a DSpark round on the CPU took 333 ms instead of 7)."""
    aux = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(if_true, cache)[1])

    def trip(fn):
        def body(carry):
            return fn(carry[0]) + (jnp.bool_(False),)
        return body

    carry = jax.lax.while_loop(lambda c: c[2] & pred, trip(if_true), (cache, aux, jnp.bool_(True)))
    if if_false is not None:
        carry = jax.lax.while_loop(lambda c: c[2], trip(if_false), carry)
    return carry[0], carry[1]


def switch(index: jax.Array, branches: tuple[Callable, ...], cache: Any) -> tuple[Any, Any]:
    """branches[index](cache), each branch returning (cache, aux) of the same shapes, as
    `one_of` runs its two: one while loop of at most one trip per branch (a `lax.switch` over the
    donated cache would copy every pool into its branches)."""
    aux = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(branches[0], cache)[1])
    carry = (cache, aux)
    for j, fn in enumerate(branches):
        def body(c, fn=fn):
            return fn(c[0]) + (jnp.bool_(False),)
        carry = jax.lax.while_loop(lambda c, j=j: c[2] & (index == j), body, carry + (jnp.bool_(True),))[:2]
    return carry


def round_widths(s: int) -> tuple[int, ...]:
    """The token counts a verification round's forward may take per row, for blocks of s slots:
    the powers of two below s, then s. A round runs the smallest that holds its widest row's
    last token and drafts: a CPU's forward grows with its rows (SmolLM2 at batch 1 on a 2-core
    EPYC: 8 rows cost 1.9x one, 2 rows 1.14x), and the drafter usually sends fewer than k."""
    return tuple(sorted({1 << i for i in range(max(s - 1, 0).bit_length())} | {s}))


def round_width_index(sent: jax.Array, widths: tuple[int, ...]) -> jax.Array:
    """Index into widths of the narrowest width w with w >= every row's sent + 1 (sent [b]:
    drafts each row sends, 0 for rows that feed nothing)."""
    need = jnp.max(sent, initial=0) + 1
    return jnp.sum(jnp.asarray(widths, jnp.int32) < need).astype(jnp.int32)


def finite_rows(logits: jax.Array) -> jax.Array:
    """Whether each row of logits [..., v] is finite throughout ([...])."""
    return all_finite(logits)


def banned_ids(stop: StopArrays) -> jax.Array:
    """[b, e + s]: the ids min_tokens keeps from being sampled (EOS unless ignore_eos, stop ids)."""
    b = stop.stop_ids.shape[0]
    eos = jnp.where(stop.ignore_eos[:, None], -1, jnp.broadcast_to(stop.eos_ids, (b,) + stop.eos_ids.shape))
    return jnp.concatenate([eos, stop.stop_ids], axis=1)


def constrain(scores: jax.Array, stop: StopArrays, num_out: jax.Array, penalties: PenaltyArrays | None = None,
              allowed: jax.Array | None = None) -> jax.Array:
    """Scores [b, v] for the next token of rows that have produced num_out [b] tokens: penalties
    and logit bias, EOS and stop ids banned before min_tokens, then a grammar's allowed mask [b, v]."""
    if penalties is not None:
        scores = apply_penalties(scores, penalties)
    scores = ban_tokens(scores, banned_ids(stop), num_out < stop.min_tokens)
    if allowed is not None:
        scores = apply_allowed(scores, allowed)
    return scores


def stop_hit(ids: jax.Array, num_out: jax.Array, stop: StopArrays) -> jax.Array:
    """Whether each new token ends its row: ids [b] or [b, s], produced after num_out tokens
    (same shape). EOS (unless ignore_eos) or a stop id, once min_tokens have been produced."""
    extra = (1,) * (ids.ndim - 1)
    b = ids.shape[0]
    hit = jnp.isin(ids, stop.eos_ids) & ~stop.ignore_eos.reshape((b,) + extra)
    hit |= jnp.any(ids[..., None] == stop.stop_ids.reshape((b,) + extra + (-1,)), axis=-1)
    return hit & (num_out >= stop.min_tokens.reshape((b,) + extra))


def hand_over(sink: Callable | None, stream, step, last_step, out_ids, out_lp, stopped, num_top: int):
    """Inside a loop: hands the host the call's outputs so far (the buffers the loop fills, -1
    where nothing is yet) through sink(call id, ids, stopped, *logprobs) (`weld.engine.streaming`)
    after every stream[0]-th step but the last (its outputs come back with the call); stream[1]
    is the call's id. stream[0] == 0: never. Returns stream for the next step (a loop carries it:
    each hand-over takes the id the one before returned, which keeps them in order)."""
    if sink is None or stream is None:
        return stream
    every, call_id = stream[0], stream[1]

    def put():
        return stream.at[1].set(sink(call_id, out_ids, stopped, *(out_lp if num_top else ())))

    fire = (every > 0) & ((step + 1) % jnp.maximum(every, 1) == 0) & ~last_step
    return jax.lax.cond(fire, put, lambda: stream)


def _allowed(bitmask: jax.Array | None, vocab_size: int) -> jax.Array | None:
    return None if bitmask is None else unpack_bitmask(bitmask, vocab_size)


def copy_slots(cache, src, dst):
    """The cache with the recurrent state of slots src [n] copied into slots dst [n] (pairs with
    a negative id copy nothing; every source is read before any destination is written)."""
    return cache.copy_slots(src, dst)


def prefill(forward: Callable, drafter: Any, weights, cache, draft_params, draft_state, tokens, positions,
            block_tables, last_index, state_slots, sampling: SamplingArrays, stop: StopArrays, penalties,
            prompt_targets, token_bitmask, *, cfg, num_top: int, with_prompt_logprobs: bool):
    """forward + sample for one padded batch of row groups.

    tokens, positions, block_tables, last_index, state_slots (or None): tuples with one entry per
    group; group 0 holds prompt chunks [bp, tp], an optional group 1 holds decode rows [bd, 1].
    The per-row arrays cover the groups' rows in order ([bp + bd]). Prompt logprobs (of prompt_targets [bp, tp])
    are computed for group 0. A drafter observes the same tokens, so its state (same pages,
    same block tables) covers every computed position too.
    Returns (cache, draft_state, ids [b, 1], logprobs of them or None, prompt logprobs or None,
    stopped [b]).
    """
    full = tuple(with_prompt_logprobs and g == 0 for g in range(len(tokens)))
    indices = tuple(None if f else li[:, None] for f, li in zip(full, last_index))
    capture = drafter.capture_layers if drafter is not None else ()
    logits, features, cache = forward(weights, cfg, tokens, positions, cache,
                                      AttentionBatch(block_tables=block_tables, state_slots=state_slots),
                                      indices, capture_layers=capture)
    if drafter is not None:
        draft_state = drafter.observe(draft_params, draft_state, tokens, positions, block_tables, last_index, features)
    last_logits = jnp.concatenate([
        jnp.take_along_axis(lg, li[:, None, None], axis=1)[:, 0] if f else lg[:, 0]
        for lg, li, f in zip(logits, last_index, full)])  # [bp + bd, v]
    prompt = token_logprobs(logits[0], prompt_targets, num_top) if with_prompt_logprobs else None
    scores = constrain(last_logits, stop, stop.num_output, penalties, _allowed(token_bitmask, cfg.vocab_size))
    ids = jnp.where(finite_rows(last_logits), sample(scores, sampling), NONFINITE)
    chosen = None
    if num_top:
        chosen = tuple(x[:, None] for x in token_logprobs(last_logits, jnp.maximum(ids, 0), num_top))  # [b, 1, ...]
    stopped = stop_hit(ids, stop.num_output, stop) & (stop.max_steps > 0)
    return cache, draft_state, ids[:, None], chosen, prompt, stopped


def decode(forward: Callable, drafter: Any, weights, cache, draft_params, draft_state, tokens, positions, block_tables,
           state_slots, sampling: SamplingArrays, stop: StopArrays, penalties, token_bitmask, stream=None, *, cfg,
           steps: int, num_top: int, sink: Callable | None = None):
    """Up to `steps` decode steps in one device call.

    tokens, positions [b]: each row's last token (not yet in the cache) and its position.
    Each step feeds one token per live row, samples the next (key from the row's seed and the
    new position, so results do not depend on how steps are grouped into calls), and ends the
    row on `stop_hit` or its step budget; a finished row feeds padding (writes nothing) for the
    rest of the call, and the loop ends early when every row has finished. token_bitmask masks
    the first step only: a constrained row has a step budget of 1 (its next mask is computed on
    the host). A finished row's padding leaves its recurrent state too as it was. A drafter
    (an engine that speculates, running a plain call) observes every step, so its state covers
    every position when the next call drafts. stream, sink: `hand_over` after each step.
    Returns (cache, draft_state, ids [b, steps] (-1 after a row ended), logprobs or None, stopped [b],
    stream): the last hand-over's id, returned so that the hand-overs, which JAX sees as pure (see
    `weld.kernels.cpu.stream_put`), are not pruned from the loop.
    """
    b = tokens.shape[0]
    batch = AttentionBatch(block_tables=block_tables, state_slots=state_slots)
    capture = drafter.capture_layers if drafter is not None else ()
    first_allowed = _allowed(token_bitmask, cfg.vocab_size)  # [b, v]
    out_ids = jnp.full((b, steps), -1, jnp.int32)
    out_lp = (jnp.zeros((b, steps), jnp.float32), jnp.zeros((b, steps), jnp.int32),
              jnp.zeros((b, steps, num_top), jnp.int32), jnp.zeros((b, steps, num_top), jnp.float32))

    def cond(carry):
        i, done = carry[0], carry[5]
        return (i < steps) & ~jnp.all(done)

    def body(carry):
        i, cache, draft_state, tok, pos, done, num_out, out_ids, out_lp, pen, stopped, stream = carry
        live = ~done
        fed = jnp.where(live, pos, -1)[:, None]
        logits, features, cache = forward(weights, cfg, tok[:, None], fed, cache, batch, jnp.zeros((b, 1), jnp.int32),
                                          capture_layers=capture)
        if drafter is not None:
            draft_state = drafter.observe(draft_params, draft_state, (tok[:, None],), (fed,), (block_tables,),
                                          (jnp.zeros((b,), jnp.int32),), (features,))
        logits = logits[:, 0]  # [b, v]
        allowed = None if first_allowed is None else first_allowed | (i > 0)
        finite = finite_rows(logits)
        new = sample(constrain(logits, stop, num_out, pen, allowed), dataclasses.replace(sampling, position=pos + 1))
        new = jnp.where(finite, new, NONFINITE)
        hit = live & stop_hit(new, num_out, stop)
        ended = hit | ~finite | (i + 1 >= stop.max_steps)
        num_out = num_out + live
        out_ids = out_ids.at[:, i].set(jnp.where(live, new, -1))
        if num_top:
            out_lp = tuple(buf.at[:, i].set(x) for buf, x in zip(out_lp, token_logprobs(logits, jnp.maximum(new, 0),
                                                                                         num_top)))
        if pen is not None:
            counted = jnp.where(live & finite, new, logits.shape[-1])  # out of bounds: dropped
            pen = dataclasses.replace(pen, counts=pen.counts.at[jnp.arange(b), counted].add(1, mode="drop"))
        tok = jnp.where(live & finite, new, tok)
        pos = jnp.where(live, pos + 1, pos)
        done, stopped = done | (live & ended), stopped | hit
        stream = hand_over(sink, stream, i, (i + 1 >= steps) | jnp.all(done), out_ids, out_lp, stopped, num_top)
        return i + 1, cache, draft_state, tok, pos, done, num_out, out_ids, out_lp, pen, stopped, stream

    carry = (jnp.int32(0), cache, draft_state, tokens, positions, stop.max_steps <= 0, stop.num_output, out_ids,
             out_lp, penalties, jnp.zeros((b,), bool), stream)
    _, cache, draft_state, _, _, _, _, out_ids, out_lp, _, stopped, stream = jax.lax.while_loop(cond, body, carry)
    return cache, draft_state, out_ids, (out_lp if num_top else None), stopped, stream


def verify(forward: Callable, drafter: Any, weights, cache, draft_params, draft_state, tokens, positions, num_drafts,
           host_drafted, history, block_tables, state_slots, sampling: SamplingArrays, stop: StopArrays, penalties,
           token_bitmask, stream=None, *, cfg, num_top: int, rounds: int, sink: Callable | None = None):
    """Up to `rounds` speculative rounds (propose -> verify -> accept) in one device call.

    tokens [b, k+1]: each row's last token (not yet in the cache), then its host drafts, ignored
    past num_drafts [b]. The drafter (n-gram lookup, a draft model, DSpark) makes each round's
    drafts here, and a row sends at most min(num_drafts, what the drafter offers). Rows with
    host_drafted [b] send the host's drafts instead, in round 0 only, and end the call after it:
    a grammar-constrained row, whose masks the host computed along its drafts (token_bitmask
    [b, k+1, ceil(v / 32)]: slot j's allowed tokens after drafts 0..j-1). Without a drafter
    every row is host-drafted. history [b, w]: each row's tokens by position, for a drafter
    that reads them (else None); the loop writes each accepted token into it. positions [b]: the
    last token's position; stop.max_steps [b]: tokens the row may produce in this call (its
    pages hold that many slots).

    A round scores each row's last token and drafts in one forward and accepts on device
    (`acceptance.coupled_accept`: each slot's token is the target's own draw there, as plain
    decoding draws it, and the drafts equal to those draws are kept, so a row's tokens are
    exactly those of plain decoding, greedy or sampled). Rejected slots leave K/V past the row's new length, overwritten before read.
    A recurrent state cannot be cut back like that: the forward advances it over every fed
    token, so when any row rejected a draft, each row's state is restored from before the
    forward and recomputed over the `count` tokens the row keeps (a second forward, with the
    rest masked; its attention layers rewrite the same K/V). Penalties apply to slot 0 (rows
    using them send no drafts); min_tokens applies to every slot. stream, sink: `hand_over`
    after each round.
    Returns (cache, draft_state, ids [b, rounds * (k+1)] (the row's tokens, then -1), logprobs
    or None, (drafts sent, accepted) [b, rounds] each (-1: not in that round), stopped [b], stream
    (as `decode` returns it)).
    """
    from weld.engine.spec.acceptance import coupled_accept

    b, s = tokens.shape
    width = rounds * s
    batch = AttentionBatch(block_tables=block_tables, state_slots=state_slots)
    allowed = None
    if token_bitmask is not None:  # [b, s, v]
        allowed = unpack_bitmask(token_bitmask.reshape(b * s, -1), cfg.vocab_size).reshape(b, s, -1)
    slot = jnp.arange(s, dtype=jnp.int32)[None, :]
    rows = jnp.arange(b)[:, None]
    host_drafted = host_drafted if drafter is not None else jnp.ones((b,), bool)
    capture = drafter.capture_layers if drafter is not None and drafter.observes_verify else ()
    out_lp = (jnp.zeros((b, width), jnp.float32), jnp.zeros((b, width), jnp.int32),
              jnp.zeros((b, width, num_top), jnp.int32), jnp.zeros((b, width, num_top), jnp.float32))
    sent_log = (jnp.full((b, rounds), -1, jnp.int32), jnp.full((b, rounds), -1, jnp.int32))
    ban_slots = jax.vmap(lambda sc, n: constrain(sc, stop, n), in_axes=(1, 1), out_axes=1)  # min_tokens per slot

    def cond(carry):
        r, done = carry[0], carry[4]
        return (r < rounds) & ~jnp.all(done)

    def body(carry):
        r, cache, draft_state, last, done, made, out_ids, out_lp, sent_log, pen, stopped, history, stream = carry
        live = ~done
        budget = jnp.where(live, stop.max_steps - made, 0)  # slots the row still owns
        pos = positions + made
        from_host = host_drafted & (r == 0)
        feed, sent = tokens.at[:, 0].set(last), num_drafts
        if drafter is not None:
            draft_state, drafted, wanted = drafter.propose(draft_params, draft_state, weights, last, pos,
                                                           block_tables, budget, s - 1, history)
            feed = jnp.where(from_host[:, None], feed, jnp.concatenate([last[:, None], drafted], axis=1))
            sent = jnp.where(from_host, sent, jnp.minimum(sent, wanted))
        sent = jnp.where(live, jnp.clip(jnp.minimum(sent, budget - 1), 0, s - 1), 0)
        fed_positions = jnp.where(live[:, None] & (slot <= sent[:, None]), pos[:, None] + slot, -1)
        saved = cache.take_slots(state_slots) if state_slots is not None else None  # the states before the forward
        def scored(fed: int):  # the forward over the first `fed` slots, its outputs padded to s
            def run(cache):
                logits, features, cache = forward(weights, cfg, feed[:, :fed], fed_positions[:, :fed], cache, batch,
                                                  capture_layers=capture)
                pad = lambda x: jnp.pad(x, [(0, 0), (0, s - fed)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
                return cache, jax.tree.map(pad, (logits, features))  # features: None without capture
            return run

        # The forward takes as many tokens per row as the widest row feeds, rounded up to a
        # power of two (`round_widths`): a round where no row sends a draft (the drafter unsure,
        # no n-gram match) is a plain decode step, one token per row, not s (the kernels' cost
        # grows with the rows).
        widths = round_widths(s)
        cache, (logits, features) = (scored(s)(cache) if s == 1 else
                                     switch(round_width_index(sent, widths), tuple(map(scored, widths)), cache))
        if capture:
            draft_state = drafter.observe(draft_params, draft_state, (feed,), (fed_positions,), (block_tables,),
                                          (jnp.zeros((b,), jnp.int32),), (features,))
        num_out = stop.num_output + made
        scores = ban_slots(logits, num_out[:, None] + slot)
        if pen is not None:  # slot 0 only: penalised rows send no drafts
            scores = scores.at[:, 0].set(constrain(logits[:, 0], stop, num_out, pen))
        if allowed is not None:  # the host's masks hold for its drafts, in round 0
            scores = jnp.where(from_host[:, None, None], apply_allowed(scores, allowed), scores)
        accepted, emitted = coupled_accept(scores, feed[:, 1:], sent, dataclasses.replace(sampling, position=pos + 1))
        # The row emits its accepted drafts and one more token, within its budget, up to and
        # including its first stop.
        count = jnp.minimum(accepted + 1, budget)
        is_stop = stop_hit(emitted, num_out[:, None] + slot, stop) & (slot < count[:, None])
        first_stop = jnp.min(jnp.where(is_stop, slot, s), axis=1)
        count = jnp.minimum(count, first_stop + 1)
        # A slot whose logits are not finite emits nothing, nor does any after it; the row ends
        # with NONFINITE where that token would have gone.
        first_bad = jnp.min(jnp.where(finite_rows(logits), s, slot), axis=1)
        faulted = live & (first_bad < count)
        count = jnp.where(live, jnp.minimum(count, first_bad), 0)
        keep = slot < count[:, None]
        if state_slots is not None:  # fed sent + 1 tokens, keeps count: recompute the state over those
            def replay(cache):
                _, _, cache = forward(weights, cfg, feed, jnp.where(keep, fed_positions, -1),
                                      cache.put_slots(saved, state_slots), batch, jnp.zeros((b, 1), jnp.int32))
                return cache, ()

            cache, _ = one_of(jnp.any(live & (count < sent + 1)), replay, None, cache)
        target = jnp.where(keep, made[:, None] + slot, width)  # out of bounds: dropped
        out_ids = out_ids.at[rows, target].set(emitted, mode="drop")
        out_ids = out_ids.at[jnp.arange(b), jnp.where(faulted, made + count, width)].set(NONFINITE, mode="drop")
        if history is not None:  # emitted token j sits at position pos + 1 + j
            history = history.at[rows, jnp.where(keep, pos[:, None] + 1 + slot, history.shape[1])].set(
                emitted, mode="drop")
        if num_top:
            chosen = token_logprobs(logits, jnp.maximum(emitted, 0), num_top)
            out_lp = tuple(buf.at[rows, target].set(x, mode="drop") for buf, x in zip(out_lp, chosen))
        if pen is not None:
            ids = jnp.where(keep, emitted, logits.shape[-1])
            pen = dataclasses.replace(pen, counts=pen.counts.at[rows, ids].add(1, mode="drop"))
        sent_log = (sent_log[0].at[:, r].set(jnp.where(live, sent, -1)),
                    sent_log[1].at[:, r].set(jnp.where(live, jnp.minimum(accepted, sent), -1)))
        last = jnp.where(live, jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0], last)
        hit = live & (first_stop < count)
        made = made + count
        done = done | hit | faulted | (made >= stop.max_steps) | from_host
        stopped = stopped | hit
        stream = hand_over(sink, stream, r, (r + 1 >= rounds) | jnp.all(done), out_ids, out_lp, stopped, num_top)
        return r + 1, cache, draft_state, last, done, made, out_ids, out_lp, sent_log, pen, stopped, history, stream

    carry = (jnp.int32(0), cache, draft_state, tokens[:, 0], stop.max_steps <= 0, jnp.zeros((b,), jnp.int32),
             jnp.full((b, width), -1, jnp.int32), out_lp, sent_log, penalties, jnp.zeros((b,), bool), history, stream)
    _, cache, draft_state, _, _, _, out_ids, out_lp, sent_log, _, stopped, _, stream = jax.lax.while_loop(
        cond, body, carry)
    return cache, draft_state, out_ids, (out_lp if num_top else None), sent_log, stopped, stream
