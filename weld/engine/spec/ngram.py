"""n-gram prompt lookup: drafts copied from earlier in the sequence, with no model at all.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method): when the
last n tokens occurred before in the prompt or the output, the tokens that followed them then are
a good guess for what follows now (code edits, quoting, summaries, repeated structure).
The longest matching suffix wins (n from max_n down to min_n); among its occurrences the most
recent one, whose continuation is the freshest. Drafts are deterministic: verify them with
`rejection_accept(..., draft_probs=None)` or `greedy_accept`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

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
