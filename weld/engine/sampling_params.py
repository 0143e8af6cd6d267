"""SamplingParams: how to sample one request, in the shape vLLM users already write.

Pure Python (the scheduler imports it; no jax here). Invalid values raise `InvalidInputError`
naming the parameter and the value.
"""

from __future__ import annotations

import dataclasses
import functools
import json as _json
from typing import Any

from weld.utils.errors import InvalidInputError

MAX_LOGPROBS = 20
# Sampling where neither the request nor the model says otherwise: llama.cpp's CLI defaults (the
# CLI's flags, the server's fallback when the model has no generation_config.json, distillation).
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# the fields' neutral values (SamplingParams' own defaults: plain sampling at temperature 1)
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
# the fields of a model's generation_config.json that set sampling defaults (HF's names)
GENERATION_CONFIG_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def model_sampling_defaults(generation_config: dict | None) -> dict[str, Any]:
    """The sampling defaults a model ships (its generation_config.json, as vLLM's
    `--generation-config auto` reads it; greedy models that set `do_sample: false` get
    temperature 0), else `DEFAULT_SAMPLING`."""
    config = generation_config or {}
    found = {k: config[k] for k in GENERATION_CONFIG_FIELDS if isinstance(config.get(k), (int, float))}
    if config.get("do_sample") is False:
        found["temperature"] = 0.0
    return found or dict(DEFAULT_SAMPLING)
# Bounds on what a request controls, checked before anything is made from it: stop token ids
# become a [rows, bucket(count)] array of the device loop (each bucket its own program), stop
# strings are matched against every new piece of text, logit_bias becomes per-row arrays.
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
# A structured-output spec is compiled into a grammar before the request is queued: its text
# (the JSON schema serialized, the regex, the grammar, the choices together) and a schema's
# nesting are bounded first.
MAX_SPEC_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 32


def _nesting(value: Any) -> int:
    """How deeply dicts and lists nest in a decoded JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
_GREEDY_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must follow (vLLM's names); exactly one of:

    json: a JSON Schema (a dict, a bool, or its JSON text); regex: a regular expression (Rust
    `regex` syntax) the whole output must match; choice: the output is one of these strings;
    grammar: a Lark grammar (llguidance's dialect) or a GBNF one; json_object: any JSON object.
    `disable_any_whitespace`: JSON with no whitespace between tokens.

    Enforced by grammar-constrained decoding (weld.engine.structured). The spec is compiled once
    here, without a tokenizer, so an invalid schema, regex or grammar is an `InvalidInputError`
    when the parameters are made.
    """

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidInputError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                    f"json_object; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", _json.loads(self.json))
            except ValueError as err:
                raise InvalidInputError(f"structured_outputs.json is not valid JSON: {err}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidInputError(f"structured_outputs.json must be a JSON Schema object, got {self.json!r}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidInputError(f"structured_outputs.choice must be a non-empty list of non-empty "
                                        f"strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidInputError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.json_object not in (None, True, False):
            raise InvalidInputError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        kind = self.kind
        if kind == "json" and isinstance(self.json, dict) and _nesting(self.json) > MAX_SCHEMA_DEPTH:
            raise InvalidInputError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels")
        size = {"json": lambda: len(_json.dumps(self.json)), "regex": lambda: len(self.regex),
                "grammar": lambda: len(self.grammar), "choice": lambda: sum(len(c) for c in self.choice),
                "json_object": lambda: 0}[kind]()
        if size > MAX_SPEC_CHARS:
            raise InvalidInputError(f"structured_outputs.{kind} is {size} characters, over the limit of "
                                    f"{MAX_SPEC_CHARS}")
        self.grammar_text()  # compiles (cached), so a bad spec fails here

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """A canonical text of the spec: equal specs share one compiled grammar."""
        payload = {"json": self.json, "regex": self.regex, "choice": list(self.choice or ()), "grammar": self.grammar,
                   "json_object": True}[self.kind]
        return _json.dumps([self.kind, payload, self.disable_any_whitespace])  # key order kept: it orders the output

    def grammar_text(self) -> str:
        """The llguidance grammar of this spec (validated; raises InvalidInputError)."""
        return _llguidance_grammar(self.key)


@functools.lru_cache(maxsize=256)
def _llguidance_grammar(key: str) -> str:
    import llguidance

    kind, payload, no_whitespace = _json.loads(key)
    matcher = llguidance.LLMatcher
    json_options = {"whitespace_flexible": not no_whitespace}
    if kind == "json_object":
        kind, payload = "json", {"type": "object"}
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(payload, defaults=json_options)  # x-guidance may override
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(payload)
        elif kind == "choice":
            grammar = matcher.grammar_from_lark("start: " + " | ".join(_json.dumps(c) for c in payload))
        else:  # Lark, or GBNF (llama.cpp / xgrammar), which llguidance converts to Lark
            grammar = llguidance.grammar_from("grammar", payload)
    except ValueError as err:
        raise InvalidInputError(f"structured_outputs.{kind} is invalid: {err}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise InvalidInputError(f"structured_outputs.{kind} is invalid: {error.strip()}")
    return grammar


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
    text unless `include_stop_str_in_output`. `structured_outputs` constrains the output to a
    JSON Schema, regex, choice or grammar (a dict of StructuredOutputsParams fields is accepted);
    such a request decodes one token per device call.
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
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
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
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"{len(self.logit_bias)} entries", f"must have at most {MAX_LOGIT_BIAS} entries")
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
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"{len(self.stop)} strings", f"must hold at most {MAX_STOP_STRINGS} strings")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad("stop", f"a string of {max(len(s) for s in self.stop)} characters",
                f"must hold strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"{len(self.stop_token_ids)} ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams or a dict")

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
