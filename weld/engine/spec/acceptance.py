"""Acceptance of drafted tokens, on device: by the target's own draws (what the engine uses),
greedy, and exact rejection sampling.

The engine's drafters all draft deterministically (n-gram lookup, a drafter's argmax), and for
deterministic drafts `coupled_accept` is the simplest exact rule: every slot's token is the
target's own draw at that position (`sample`: Gumbel-max keyed by the row's seed and the
position, argmax when greedy), the leading drafts equal to those draws are accepted, and the
draw at the first mismatch is emitted. A draft d is then accepted with probability p(d), as
under rejection sampling, but the tokens are the very tokens plain decoding draws: speculation
changes how fast a seeded request runs, never what it says, whatever the drafts and the number
of drafts per round. `rejection_accept` (below) is the general rule, for drafts drawn from a
distribution q.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"). A proposer drafts d_0..d_{k-1} after a sequence's last token; the target scores the
last token and the drafts in one pass and gives k+1 distributions p_0..p_k, where p_j is the
target's distribution of the token after the prefix + d_0..d_{j-1}. Slot j judges d_j against
p_j; slot k only ever yields the bonus token.

Rejection sampling keeps the output distributed exactly as the target's:
  accept d_j with probability min(1, p_j(d_j) / q_j(d_j))         (q_j: what d_j was drawn from)
  at the first rejection, emit a draw from normalize(max(0, p_j - q_j)) and stop
  when every sent draft is accepted, emit a bonus draw from p_{n} (n = drafts sent)
For a deterministic draft (q_j one-hot on d_j) this is: accept with probability p_j(d_j), and
on rejection draw from p_j with d_j removed. Greedy rows accept the longest prefix of drafts that
equal the target's argmax and emit the argmax after it.

p_j is exactly what plain sampling (`weld.engine.sampler.sample`) would use: logits / temperature,
then the row's top-k / top-p / min-p filters. The caller applies penalties, bans and grammar masks
to each slot's logits first, as it would before `sample`.

Randomness is keyed like the sampler's, so a row's result never depends on its batch neighbours:
slot j's token has position `params.position + j`, and its draws come from the counter hash
`gumbel_noise(seed, position)`. The residual and bonus draws are Gumbel-max over the vocabulary's
noise at that position (so a bonus token is exactly the token plain sampling would pick there);
the acceptance uniform is the noise of one extra counter past the vocabulary (id V), independent
of every token's noise. A sampled drafter must key its own draws differently (`draft_sample`
does): a draft drawn with the target's noise would make rejection depend on the residual draw.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from weld.engine.sampler import SamplingArrays, argmax, filter_logits, gumbel_noise, sample

_NEG = -1e30
_DRAFT_SALT = 0x5BD1E995  # xored into seed_hi: a drafter's noise stream, apart from the target's


def _per_slot(params: SamplingArrays, num_slots: int) -> SamplingArrays:
    """Each row's parameters repeated for its slots ([b] -> [b * s]); slot j samples position + j."""
    rep = lambda x: jnp.repeat(x, num_slots)  # noqa: E731
    position = (params.position[:, None] + jnp.arange(num_slots, dtype=params.position.dtype)).reshape(-1)
    return SamplingArrays(rep(params.temperature), rep(params.top_k), rep(params.top_p), rep(params.min_p),
                          rep(params.seed_hi), rep(params.seed_lo), position)


def sampling_scores(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Each row's logits [b, v] as `sample` draws from them: / temperature, then filtered.

    softmax of the result is the distribution plain sampling uses (the filters are applied under
    the same condition as in `sample`, so both compute the same numbers).
    """
    scaled = logits / jnp.maximum(params.temperature, 1e-5)[:, None]
    needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0.0))
    return jax.lax.cond(needs_filter, lambda x: filter_logits(x, params.top_k, params.top_p, params.min_p),
                        lambda x: x, scaled)


def _noise_and_uniform(params: SamplingArrays, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Gumbel noise [b, v] of each row's position and an independent uniform [b] (counter id v)."""
    g = gumbel_noise(params.seed_hi, params.seed_lo, params.position, vocab_size + 1)
    return g[:, :vocab_size], jnp.exp(-jnp.exp(-g[:, vocab_size]))  # u = exp(-exp(-g)) inverts Gumbel


def draft_sample(logits: jax.Array, params: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """Draws draft tokens [b] from a drafter's logits [b, v] under each row's sampling parameters.

    params.position is the position of the drafted token. Returns (tokens [b], q [b, v]), q being
    the distribution each token was drawn from (pass it to `rejection_accept` as draft_probs).
    The noise is the row's seed with a salt: independent of the target's draws at that position.
    Greedy rows (temperature 0) take the argmax.
    """
    scores = sampling_scores(logits, params)
    salted = dataclasses.replace(params, seed_hi=params.seed_hi ^ jnp.uint32(_DRAFT_SALT))
    noise = gumbel_noise(salted.seed_hi, salted.seed_lo, salted.position, logits.shape[-1])
    sampled = argmax(scores + noise)
    tokens = jnp.where(params.temperature < 1e-5, argmax(logits), sampled)
    return tokens, jax.nn.softmax(scores, axis=-1)


def _emit(draft_tokens: jax.Array, num_accepted: jax.Array, last: jax.Array) -> jax.Array:
    """[b, k+1]: the accepted drafts, then `last` [b] at slot num_accepted, then -1."""
    b, k = draft_tokens.shape
    slots = jnp.arange(k + 1)[None, :]
    drafts = jnp.concatenate([draft_tokens, jnp.full((b, 1), -1, draft_tokens.dtype)], axis=1)
    out = jnp.where(slots < num_accepted[:, None], drafts, -1)
    return jnp.where(slots == num_accepted[:, None], last[:, None], out).astype(jnp.int32)


def _leading(accepted: jax.Array) -> jax.Array:
    """Length of each row's leading run of True in accepted [b, k]."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _sent(num_drafts: jax.Array, k: int) -> jax.Array:
    """bool [b, k]: which slots hold a draft the row sent for verification."""
    return jnp.arange(k)[None, :] < jnp.clip(num_drafts, 0, k)[:, None]


def greedy_accept(target_logits: jax.Array, draft_tokens: jax.Array,
                  num_drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy verification.

    target_logits f32 [b, k+1, v]: slot j scores the token after the prefix + drafts 0..j-1.
    draft_tokens i32 [b, k]; num_drafts i32 [b]: how many of them each row sent (the rest are
    ignored). Returns (num_accepted i32 [b], tokens i32 [b, k+1]): the accepted drafts followed by
    the target's argmax after them, padded with -1; a row emits num_accepted + 1 tokens.
    """
    k = draft_tokens.shape[1]
    target_ids = argmax(target_logits)  # [b, k+1]
    num_accepted = _leading((draft_tokens == target_ids[:, :k]) & _sent(num_drafts, k))
    last = jnp.take_along_axis(target_ids, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, _emit(draft_tokens, num_accepted, last)


def coupled_accept(scores: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array,
                   params: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """Verification of deterministic drafts by the target's own draws (see the module docstring).

    scores f32 [b, k+1, v]: each slot's logits after penalties, bans and masks (what `sample`
    takes); draft_tokens i32 [b, k]; num_drafts i32 [b]; params.position: the position of the
    token slot 0 decides. Returns (num_accepted i32 [b], tokens i32 [b, k+1] padded with -1), as
    `greedy_accept`: the row's tokens are its first num_accepted + 1 draws.
    """
    b, s, v = scores.shape
    draws = sample(scores.reshape(b * s, v), _per_slot(params, s)).reshape(b, s)  # [b, k+1]
    num_accepted = _leading((draft_tokens == draws[:, :s - 1]) & _sent(num_drafts, s - 1))
    return num_accepted, jnp.where(jnp.arange(s)[None, :] <= num_accepted[:, None], draws, -1).astype(jnp.int32)


def rejection_accept(target_logits: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array,
                     params: SamplingArrays, draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Verification by exact rejection sampling; rows with temperature 0 verify greedily.

    target_logits f32 [b, k+1, v]; draft_tokens i32 [b, k]; num_drafts i32 [b] (drafts sent per
    row). params: each row's sampling parameters, params.position being the position of the token
    slot 0 decides (the first draft's). draft_probs f32 [b, k, v]: the distribution q_j each draft
    was drawn from, or None for deterministic drafts (n-gram lookup, a drafter's argmax).
    Returns (num_accepted i32 [b], tokens i32 [b, k+1] padded with -1), as `greedy_accept`.
    """
    b, s, v = target_logits.shape
    k = s - 1
    greedy_accepted, greedy_tokens = greedy_accept(target_logits, draft_tokens, num_drafts)
    safe_drafts = jnp.clip(draft_tokens, 0, v - 1)[..., None]  # unsent slots may hold -1

    def verify(target_logits):
        slot_params = _per_slot(params, s)
        scores = sampling_scores(target_logits.reshape(b * s, v), slot_params)  # [b*s, v]
        noise, uniform = _noise_and_uniform(slot_params, v)
        scores, noise, uniform = scores.reshape(b, s, v), noise.reshape(b, s, v), uniform.reshape(b, s)
        p = jax.nn.softmax(scores[:, :k], axis=-1)  # [b, k, v]
        p_draft = jnp.take_along_axis(p, safe_drafts, axis=-1)[..., 0]  # p_j(d_j)
        if draft_probs is None:  # q_j(d_j) = 1: accept with probability p_j(d_j)
            accepted = uniform[:, :k] < p_draft
        else:  # u < min(1, p / q)  <=>  u * q < p, for u in (0, 1)
            q_draft = jnp.take_along_axis(draft_probs, safe_drafts, axis=-1)[..., 0]
            accepted = uniform[:, :k] * q_draft < p_draft
        num_accepted = _leading(accepted & _sent(num_drafts, k))
        # The last token comes from slot a = num_accepted: the residual if d_a was rejected, else
        # (every sent draft accepted) the bonus, a plain draw from p_a.
        a = num_accepted[:, None, None]
        scores_a = jnp.take_along_axis(scores, a, axis=1)[:, 0]  # [b, v]
        noise_a = jnp.take_along_axis(noise, a, axis=1)[:, 0]
        slot = jnp.minimum(a, k - 1)  # a draft slot to read (ignored when a is the bonus slot)
        p_a = jnp.take_along_axis(p, slot, axis=1)[:, 0]
        if draft_probs is None:
            d_a = jnp.take_along_axis(draft_tokens, slot[:, :, 0], axis=1)
            residual = jnp.where(jnp.arange(v)[None, :] == d_a, 0.0, p_a)
        else:
            residual = jnp.maximum(p_a - jnp.take_along_axis(draft_probs, slot, axis=1)[:, 0], 0.0)
        # max(0, p - q) sums to 0 only where p = q, where rejection cannot happen; keep it finite.
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_a)
        log_residual = jnp.where(residual > 0, jnp.log(residual), _NEG)
        rejected = num_accepted < jnp.clip(num_drafts, 0, k)
        last = argmax(jnp.where(rejected[:, None], log_residual, scores_a) + noise_a)
        sampled_tokens = _emit(draft_tokens, num_accepted, last)
        greedy = params.temperature < 1e-5
        return (jnp.where(greedy, greedy_accepted, num_accepted),
                jnp.where(greedy[:, None], greedy_tokens, sampled_tokens))

    return jax.lax.cond(jnp.any(params.temperature >= 1e-5), verify,
                        lambda _: (greedy_accepted, greedy_tokens), target_logits)
