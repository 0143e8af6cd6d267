"""SamplingParams: how to sample one request, in the shape vLLM users already write.

Pure Python (the scheduler imports it; no jax here). Invalid values raise `InvalidInputError`
naming the parameter and the value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from weld.utils.errors import InvalidInputError

MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling parameters.

    temperature 0 means greedy. top_k <= 0 and top_p = 1 disable those filters. Penalties follow
    vLLM/OpenAI: presence and frequency penalties count generated tokens; the repetition penalty
    (HF/CTRL style, > 1 discourages) covers prompt and generated tokens; `logit_bias` adds to
    the logits of the given token ids (values in [-100, 100]). `seed` makes a
    request reproducible whatever its batch neighbours are. `logprobs`: how many top
    alternatives to return per generated token (the chosen token is always included);
    `prompt_logprobs` the same for prompt tokens. Stop strings are removed from the output
    text unless `include_stop_str_in_output`.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: Any, why: str):
            raise InvalidInputError(f"{name} {why}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            bad("max_tokens", self.max_tokens, "must be an integer >= 0")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", self.temperature, "must be a number in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", self.top_k, "must be an integer; 0 or -1 disables it")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                bad(name, value, "must be a number in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", self.repetition_penalty, "must be in (0, 10]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", self.logit_bias, "must map token ids to numbers")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                bad("logit_bias", self.logit_bias, "must map token ids to numbers")
            if any(k < 0 or not -100 <= v <= 100 for k, v in self.logit_bias.items()):
                bad("logit_bias", self.logit_bias, "must map token ids >= 0 to values in [-100, 100]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", self.seed, "must be an integer")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, value, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
