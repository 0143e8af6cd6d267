"""Grammar-constrained decoding on the host side, with llguidance: one matcher per sequence.

Each step, a constrained sequence's matcher writes the set of tokens its grammar allows next as
a bitmask (int32 words, bit j of word w = token 32 * w + j, the layout llguidance fills); the
runner applies it to the logits on device before sampling, and the sampled token is fed back
with `accept`. The scheduler gives a constrained sequence one token per device call, since its
mask changes after every token; under speculative decoding, one round: the host drafts and
`draft_bitmasks` writes the mask of every drafted position by walking the drafts and back.

The llguidance tokenizer is built from weld's `tokenizers.Tokenizer` (its JSON serialisation)
the first time a constrained request comes (~1 s for a 49k vocabulary), so engines that never
see one never pay for it. Compiled grammars are cached by the spec's key: a new sequence gets a
copy of the cached matcher, in its start state. No jax here.
"""

from __future__ import annotations

import collections

import numpy as np

from weld.engine.sampling_params import StructuredOutputsParams
from weld.tokenizer import Tokenizer
from weld.utils.errors import InvalidInputError


class StructuredOutputError(RuntimeError):
    """A sampled token that the grammar rejects: the mask and the sampler disagree (a bug)."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask over `vocab_size` ids."""
    return -(-vocab_size // 32)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, tokenizer_vocab_size: int, describe):
        self._matcher = matcher
        self._words = bitmask_width(tokenizer_vocab_size)
        self._tail_bits = tokenizer_vocab_size % 32  # used bits of the last word (0: all 32)
        self._describe = describe  # token id -> readable text, for error messages

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row`, int32 [bitmask_width(model vocab)]. Ids the
        tokenizer does not have (a model vocabulary padded past it) stay disallowed."""
        if row.dtype != np.int32 or row.ndim != 1 or not row.flags["C_CONTIGUOUS"] or row.size < self._words:
            raise ValueError(f"bitmask row must be contiguous int32 of >= {self._words} words, "
                             f"got {row.dtype} {row.shape}")
        row[:] = 0
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._words * 4)
        if self._tail_bits:
            row[self._words - 1] &= np.int32((1 << self._tail_bits) - 1)
        if self._matcher.is_error():
            raise StructuredOutputError(f"the grammar matcher failed: {self._matcher.get_error()}")

    def draft_bitmasks(self, drafts: list[int], out: np.ndarray) -> int:
        """For the longest prefix of `drafts` the grammar accepts (n tokens, at most len(out) - 1),
        writes into out[j] (int32 [slots, words]) the tokens allowed after drafts[:j], j = 0..n,
        and returns n. The matcher ends where it began."""
        n = min(self._matcher.validate_tokens([int(t) for t in drafts]), len(out) - 1)
        for j in range(n + 1):
            self.fill_bitmask(out[j])
            if j < n:
                self.accept(drafts[j])
        if n and not self._matcher.rollback(n):
            raise StructuredOutputError(f"the grammar matcher could not roll back {n} drafted tokens: "
                                        f"{self._matcher.get_error()}")
        return n

    def accept(self, token: int) -> None:
        """Advances past `token`; a token the grammar does not allow raises StructuredOutputError."""
        if not self._matcher.consume_token(int(token)):
            raise StructuredOutputError(
                f"token {token} ({self._describe(token)}) was sampled but the grammar does not allow it "
                f"(a bug: the token bitmask should have excluded it): {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and allows nothing more (the output must end here)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete match (it may still continue)."""
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Makes matchers for one engine's tokenizer; compiled grammars are kept by key (LRU)."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], cache_size: int = 64):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids) or tuple(tokenizer.eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer = None
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()

    @property
    def ll_tokenizer(self):
        """The llguidance tokenizer (built on first use)."""
        if self._ll_tokenizer is None:
            import llguidance

            backend = self.tokenizer.backend
            try:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.tokenizer.vocab_size, eos_token=list(self.eos_token_ids))
            except Exception as err:  # the library raises plain exceptions for tokenizers it cannot read
                raise InvalidInputError(f"structured outputs are not available for this tokenizer: {err}") from None
        return self._ll_tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for `spec`, at the start of its grammar. Raises InvalidInputError for a
        spec that cannot be compiled against this tokenizer."""
        import llguidance

        key = spec.key
        proto = self._compiled.get(key)
        if proto is None:
            proto = llguidance.LLMatcher(self.ll_tokenizer, spec.grammar_text(), log_level=0)
            if proto.is_error():
                raise InvalidInputError(f"structured_outputs.{spec.kind} is invalid: {proto.get_error()}")
            self._compiled[key] = proto
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return GrammarMatcher(proto.deep_copy(), self.tokenizer.vocab_size, self._describe)

    def _describe(self, token: int) -> str:
        if not 0 <= token < self.tokenizer.vocab_size:
            return "outside the tokenizer's vocabulary"
        return repr(self.tokenizer.decode([token], skip_special_tokens=False))
