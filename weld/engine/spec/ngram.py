"""n-gram prompt lookup: drafts copied from earlier in the sequence, with no model at all.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method): when the
last n tokens occurred before in the prompt or the output, the tokens that followed them then are
a good guess for what follows now (code edits, quoting, summaries, repeated structure).
The longest matching suffix wins (n from max_n down to min_n); among its occurrences the most
recent one, whose continuation is the freshest. Drafts are deterministic: verify them with
`coupled_accept` (what the engine does), `rejection_accept(..., draft_probs=None)` or `greedy_accept`.

`lookup` is the same rule on the device, over a batch of token histories, so that drafting runs
inside the verification loop (`drafters.NgramDrafter`); `propose_ngram` (numpy) is its reference
twin and drafts on the host for grammar-constrained rows.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to k draft tokens continuing token_ids (prompt + output so far); [] when no suffix of
    min_n..max_n tokens occurred earlier."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows of n tokens that start before the suffix and have a token after them: [L - n, n].
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        starts = np.flatnonzero(np.all(windows == tokens[length - n:], axis=1))
        if len(starts):
            follow = starts[-1] + n
            return tokens[follow:follow + k].tolist()
    return []


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Proposes up to k drafts per sequence by longest-suffix lookup (n from max_n down to min_n)."""

    k: int = 4
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k (drafts per step) must be >= 1, got {self.k}")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        return propose_ngram(token_ids, self.k, self.min_n, self.max_n)

    def propose_batch(self, sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Drafts int32 [b, k] padded with -1, and num_drafts int32 [b]: the arrays verification takes."""
        drafts = np.full((len(sequences), self.k), -1, np.int32)
        num_drafts = np.zeros(len(sequences), np.int32)
        for i, tokens in enumerate(sequences):
            proposal = self.propose(tokens)
            drafts[i, :len(proposal)] = proposal
            num_drafts[i] = len(proposal)
        return drafts, num_drafts


def lookup(history: jax.Array, length: jax.Array, k: int, min_n: int = 1,
           max_n: int = 3) -> tuple[jax.Array, jax.Array]:
    """`propose_ngram` for a batch on device.

    history int32 [b, w]: each row's tokens by position (prompt + output; anything past the row's
    length is ignored); length int32 [b]: tokens in the row (the last one at length - 1).
    Returns (drafts int32 [b, k], num int32 [b]): the tokens after the most recent earlier
    occurrence of the longest matching suffix (n from max_n down to min_n), of which num (at most
    k, 0 when nothing matched) are real; the rest of a row's drafts are junk.
    """
    b, w = history.shape
    start = jnp.arange(w, dtype=jnp.int32)[None, :]  # [1, w]: where a window of n tokens starts
    follow = jnp.zeros((b,), jnp.int32)  # where the drafts start in history
    found = jnp.zeros((b,), bool)
    for n in range(max_n, min_n - 1, -1):
        # The suffix [b, n]; a window matches where history[s + j] == suffix[j] for every j.
        suffix = jnp.take_along_axis(history, jnp.clip(length[:, None] - n + jnp.arange(n), 0, w - 1), axis=1)
        match = jnp.ones((b, w), bool)
        for j in range(n):
            shifted = jnp.concatenate([history[:, j:], jnp.full((b, j), -1, history.dtype)], axis=1)
            match &= shifted == suffix[:, j:j + 1]
        # Windows that end before the suffix's last token and have a token after them: s + n <= length - 1.
        match &= start + n <= length[:, None] - 1
        best = jnp.max(jnp.where(match, start, -1), axis=1)  # the most recent occurrence
        take = ~found & (best >= 0)
        follow = jnp.where(take, best + n, follow)
        found |= take
    drafts = jnp.take_along_axis(history, jnp.clip(follow[:, None] + jnp.arange(k), 0, w - 1), axis=1)
    num = jnp.where(found, jnp.clip(length - follow, 0, k), 0).astype(jnp.int32)
    return drafts.astype(jnp.int32), num
