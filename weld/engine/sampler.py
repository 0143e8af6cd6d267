"""Sampling on device with per-row parameters.

Every row of a batch has its own temperature, top-k, top-p, min-p and random key, so a
request's tokens do not depend on its batch neighbours: the key of a row is derived from the
request's seed and the position of the token being sampled.

Logprobs are the model's raw log-softmax (before temperature and filters), as vLLM reports.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from weld.engine.batch import PenaltyArrays, SamplingArrays, StopArrays
from weld.kernels import cpu as cpu_kernels
from weld.models.common import sharding

_NEG = -1e30


def _native(x: jax.Array) -> bool:
    """Whether a reduction over x's last axis runs as the native kernel (f32 on the CPU, one device)."""
    return x.dtype == jnp.float32 and x.shape[-1] > 0 and cpu_kernels.available() and sharding.active_mesh() is None


def argmax(x: jax.Array) -> jax.Array:
    """int32 [...]: the index of the maximum of x [..., v] over v, as jnp.argmax (the first of ties;
    a NaN counts as the maximum). On the CPU the native kernel: XLA:CPU's argmax over a vocabulary
    took longer than the LM head (weld/kernels/cpu/argmax.cc)."""
    if _native(x):
        return cpu_kernels.argmax(x)[0]
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def all_finite(x: jax.Array) -> jax.Array:
    """bool [...]: whether x [..., v] is finite throughout each row (the native kernel's second
    output on the CPU: a program that also takes argmax(x) reads x once for both)."""
    if _native(x):
        return cpu_kernels.argmax(x)[1]
    return jnp.all(jnp.isfinite(x), axis=-1)


def _register(cls) -> None:
    """The host batch's dataclasses (numpy leaves, `weld.engine.batch`) as pytrees of device arrays."""
    jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[])


for _cls in (SamplingArrays, PenaltyArrays, StopArrays):
    _register(_cls)


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer finalizer (xorshift-multiply, "lowbias32" constants): every input bit
    affects every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seed_hi: jax.Array, seed_lo: jax.Array, position: jax.Array, vocab_size: int) -> jax.Array:
    """Gumbel(0, 1) noise [b, v], a pure function of (row seed, position, token id).

    A counter-based hash rather than jax.random's threefry: at a 49k vocabulary threefry took
    22 ms per step for 16 rows on this CPU (and seconds to compile), the hash under 3 ms.
    """
    state = _mix32(_mix32(_mix32(seed_lo ^ jnp.uint32(0x9E3779B9)) ^ seed_hi) ^ position.astype(jnp.uint32))
    ids = jnp.arange(vocab_size, dtype=jnp.uint32)[None, :]
    bits = _mix32(_mix32(state[:, None] + ids * jnp.uint32(0x9E3779B9)))
    return gumbel_from_bits(bits)


def gumbel_from_bits(bits: jax.Array) -> jax.Array:
    """Gumbel(0, 1) noise from uniform uint32 bits: finite for every input.

    Uniforms have 23 bits, centred in their bins: u lies in [2^-24, 1 - 2^-24], which f32 holds
    exactly, so neither log is of 0. (With 24 bits the top bin, 1 - 2^-25, rounds to 1.0 in f32:
    noise +inf once in 2^24 draws, a token chosen whatever its logit, even a masked one.)
    """
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))


def top_values(x: jax.Array, k: int) -> jax.Array:
    """The k largest values of each row of x, descending: `lax.top_k`, kept whole. XLA:CPU runs
    top-k as a partial sort only while its result is read as one slice; when the simplifier
    splits the reads into several slices of the underlying sort (as `_cuts` reads it), the
    whole row is sorted, ~50x slower at 49,152 tokens. The barrier keeps the one slice."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k)[0])


# A row's top-k cut and nucleus are exact from its 256 largest logits when both fall inside them
# (top_k <= 256, and the 256 most likely tokens hold top_p of the mass); the 256 largest of a
# 49,152-token row take ~0.7 ms on XLA:CPU. Rows whose cuts lie further take `_searched_cuts`.
FILTER_CANDIDATES = 256


def _cuts(logits: jax.Array, cand: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """(kth [b, 1], nucleus threshold [b, 1], exact [b]) of each row from its K largest logits
    cand [b, K] (descending; K = v: all of them): a token is kept if its logit is >= both."""
    v, K = logits.shape[-1], cand.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    cut = k < v
    kth = jnp.where(cut[:, None], jnp.take_along_axis(cand, (jnp.minimum(k, K) - 1)[:, None], axis=-1), -jnp.inf)
    top = cand[:, :1]
    # The kept set's softmax normaliser: the k largest logits, counting ties at the k-th as the
    # sorted list does (exactly k terms).
    above = logits > kth
    z = jnp.sum(jnp.where(above, jnp.exp(logits - top), 0.0), axis=-1, keepdims=True)
    z = z + jnp.where(cut[:, None], (k[:, None] - jnp.sum(above, axis=-1, keepdims=True)) * jnp.exp(kth - top), 0.0)
    probs = jnp.where(jnp.arange(K)[None, :] < k[:, None], jnp.exp(cand - top), 0.0) / z
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    keep = mass_before < top_p[:, None]
    nucleus = top_p[:, None] < 1.0
    # The smallest kept value is the nucleus threshold (the top token is always kept).
    threshold = jnp.where(nucleus, jnp.min(jnp.where(keep, cand, jnp.inf), axis=-1, keepdims=True), -jnp.inf)
    exact = (K == v) | ((~cut | (k <= K)) & (~nucleus[:, 0] | ~keep[:, -1]))
    return kth, threshold, exact


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that order as the float32 values x do (-inf lowest; no key is 0; -0 just
    below +0, which is harmless: the values found are compared as floats, where they are equal)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _key_value(key: jax.Array) -> jax.Array:
    """The float32 value of an `_order_keys` key."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32((1 << 31) - 1), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_key(holds: Callable[[jax.Array], jax.Array], b: int) -> jax.Array:
    """Per row, the largest uint32 key t for which holds(t [b, 1]) -> bool [b] is true, where
    holds is true up to some key and false past it (0 when it never holds past 0): bit by bit
    from the top, 32 passes."""
    def step(i, found):
        trial = found | (jnp.uint32(1 << 31) >> i.astype(jnp.uint32))
        return jnp.where(holds(trial[:, None]), trial, found)
    return jax.lax.fori_loop(0, 32, step, jnp.zeros((b,), jnp.uint32))


def _searched_cuts(logits: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """(kth [b, 1], nucleus threshold [b, 1]) of every row, as `_cuts` gives them from a sorted
    row, without sorting it: the k-th largest logit is the largest value t
    with at least k logits >= t, and the nucleus threshold the largest t whose logits >= t (in
    the top-k set) hold top_p of its mass; each is found over the values' order keys, 32 passes
    over the row (~0.7 ms for a 49,152-token row, where XLA:CPU sorts it in ~11 ms)."""
    b, v = logits.shape
    keys = _order_keys(logits)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    cut = k < v
    kth_key = jax.lax.cond(jnp.any(cut), lambda: _largest_key(lambda t: jnp.sum(keys >= t, axis=-1) >= k, b),
                           lambda: jnp.zeros((b,), jnp.uint32))
    kth = jnp.where(cut, _key_value(kth_key), -jnp.inf)[:, None]
    top = jnp.max(logits, axis=-1, keepdims=True)
    # The top-k set's mass as `_cuts` counts it: the logits above the k-th, and the ties at the
    # k-th that make up k terms.
    above = logits > kth
    weights = jnp.where(above, jnp.exp(logits - top), 0.0)
    ties = jnp.where(cut[:, None], (k[:, None] - jnp.sum(above, axis=-1, keepdims=True)) * jnp.exp(kth - top), 0.0)
    goal = top_p[:, None] * (jnp.sum(weights, axis=-1, keepdims=True) + ties)

    def holds(t):
        mass = jnp.sum(jnp.where(keys >= t, weights, 0.0), axis=-1, keepdims=True)
        return (mass + jnp.where(t <= kth_key[:, None], ties, 0.0) >= goal)[:, 0]

    found = _largest_key(holds, b)
    threshold = jnp.where((top_p < 1.0) & (found != 0), _key_value(found), -jnp.inf)[:, None]
    return kth, threshold


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Masks (to -inf-ish) tokens outside each row's top-k, nucleus top-p and min-p sets.

    logits [b, v] are already divided by temperature. top-p keeps the smallest set of most
    likely tokens whose probability mass reaches top_p (after top-k), as HF and vLLM do; top_p
    >= 1 keeps them all. Each row's cuts come from its `FILTER_CANDIDATES` largest logits when
    they hold them, else from the search over the whole row (`_searched_cuts`): a row's result
    depends on its own logits only, whatever else is in the batch.
    """
    if logits.shape[-1] <= FILTER_CANDIDATES:
        kth, threshold = _searched_cuts(logits, top_k, top_p)
    else:
        kth, threshold, exact = _cuts(logits, top_values(logits, FILTER_CANDIDATES), top_k, top_p)
        searched = jax.lax.cond(jnp.all(exact), lambda: (kth, threshold),  # only when some row needs it
                                lambda: _searched_cuts(logits, top_k, top_p))
        kth, threshold = jnp.where(exact[:, None], kth, searched[0]), jnp.where(exact[:, None], threshold, searched[1])
    keep = (logits >= kth) & (logits >= threshold)
    # min-p keeps tokens with p >= min_p * p_max. The ratio p / p_max = exp(l - l_max) does not
    # depend on normalisation, so min-p commutes with the other filters.
    max_logit = jnp.max(logits, axis=-1, keepdims=True)
    keep &= (min_p[:, None] <= 0) | (logits >= max_logit + jnp.log(jnp.maximum(min_p[:, None], 1e-30)))
    return jnp.where(keep, logits, _NEG)


def apply_penalties(logits: jax.Array, pen: PenaltyArrays) -> jax.Array:
    """logit_bias, then the repetition penalty, then frequency and presence penalties (vLLM's order).

    repetition (CTRL / HF): a seen token's logit l becomes l / r if l > 0 else l * r.
    frequency / presence (OpenAI): l - frequency * count - presence * (count > 0).
    """
    v = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(pen.bias_ids >= 0, pen.bias_ids, v)  # padding goes out of bounds and is dropped
    logits = logits.at[rows, ids].add(pen.bias_values, mode="drop")
    generated = pen.counts > 0
    seen = generated | pen.prompt_mask
    r = pen.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - pen.frequency[:, None] * pen.counts - pen.presence[:, None] * generated


def ban_tokens(logits: jax.Array, banned_ids: jax.Array, ban: jax.Array) -> jax.Array:
    """Sets logits [b, v] of banned_ids [b, m] (padded with -1) to -inf-ish in rows where ban [b].

    Used for min_tokens: EOS and stop ids cannot be sampled before a row has that many tokens.
    """
    v = logits.shape[-1]
    ids = jnp.where((banned_ids >= 0) & ban[:, None], banned_ids, v)  # v: out of bounds, dropped
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].set(_NEG, mode="drop")


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool [b, v] from a token bitmask int32 [b, ceil(v / 32)]: token t is allowed where bit
    t % 32 of word t // 32 is set (llguidance's layout)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [b, w, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_allowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Sets logits [b, v] of tokens not allowed (bool [b, v]) to -inf-ish (grammar constraints)."""
    return jnp.where(allowed, logits, _NEG)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Token ids [b] drawn from logits [b, v] under each row's parameters (greedy where temperature is 0).

    Sampling is the Gumbel-max trick: argmax(logits / T + Gumbel noise) is a draw from
    softmax(logits / T) restricted to the tokens the filters keep. All-greedy batches skip it.
    """
    greedy_ids = argmax(logits)

    def draw(logits):
        temperature = jnp.maximum(params.temperature, 1e-5)[:, None]
        scaled = logits / temperature
        needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0.0))
        scaled = jax.lax.cond(needs_filter,
                              lambda x: filter_logits(x, params.top_k, params.top_p, params.min_p),
                              lambda x: x, scaled)
        noise = gumbel_noise(params.seed_hi, params.seed_lo, params.position, logits.shape[-1])
        sampled_ids = argmax(scaled + noise)
        return jnp.where(params.temperature < 1e-5, greedy_ids, sampled_ids)

    return jax.lax.cond(jnp.any(params.temperature >= 1e-5), draw, lambda _: greedy_ids, logits)


def token_logprobs(logits: jax.Array, token_ids: jax.Array, num_top: int):
    """Raw logprobs for chosen tokens and the top alternatives.

    logits [..., v], token_ids [...]. Returns (chosen logprob [...], chosen rank [...],
    top ids [..., num_top], top logprobs [..., num_top]); rank 1 = the most likely token.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, token_ids[..., None], axis=-1)[..., 0]
    rank = jnp.sum(logprobs > chosen[..., None], axis=-1).astype(jnp.int32) + 1
    if num_top:
        top_lp, top_ids = jax.lax.top_k(logprobs, num_top)
    else:
        top_lp = jnp.zeros(token_ids.shape + (0,), jnp.float32)
        top_ids = jnp.zeros(token_ids.shape + (0,), jnp.int32)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp

