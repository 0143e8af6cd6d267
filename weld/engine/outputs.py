"""What `LLM.generate` returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """A token's log-probability, its rank among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token plus the top alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; for "error", what went wrong

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed (vLLM's name)


class TextCursor:
    """How much of one completion's cumulative text a stream has sent.

    While a completion runs, the last (longest stop string - 1) characters are held back: the
    engine cuts a stop string out of the text once it is complete, so text that may be its start
    must not be sent yet.
    """

    def __init__(self, stop: list[str] | None):
        self.holdback = max((len(s) for s in stop or ()), default=1) - 1
        self.sent_chars = 0

    def text_delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent_chars, len(text) - self.holdback)
        delta = text[self.sent_chars:end]
        self.sent_chars = end
        return delta
