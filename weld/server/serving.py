"""What the completion and chat endpoints share: server state, admission, sampling parameters,
prompt checks, running engine requests (several at once, with metrics), and logprob shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator

from weld.engine.outputs import PositionLogprobs, RequestOutput, TextCursor
from weld.engine.sampling_params import DEFAULT_SAMPLING, NEUTRAL_SAMPLING, SamplingParams
from weld.server.errors import APIError
from weld.server.metrics import Metrics, RequestTimer
from weld.utils.errors import InvalidInputError

_MIN_LOGPROB = -9999.0  # JSON has no -inf
# The most sequences (prompts x n) one request may start: each costs host memory before the
# engine sees it. Past max_num_seqs + max_waiting a request waits for an empty queue.
MAX_REQUEST_SEQS = 4096


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    max_model_len: int
    max_num_seqs: int = 64
    max_waiting: int = 256  # sequences admitted beyond max_num_seqs before requests get a 429
    max_n: int = 128  # completions per prompt a request may ask for (`n`; OpenAI's own limit)
    max_body_bytes: int = 32 << 20  # a larger request body is a 413
    allowed_origins: tuple[str, ...] = ()  # browser origins CORS lets in (none by default; "*": any)
    # what a request that leaves a sampling field out gets: the model's generation_config.json
    # (`model_sampling_defaults`), else llama.cpp's defaults
    sampling_defaults: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    api_key: str | None = None
    model_root: str | None = None  # the path or id the model came from, for /v1/models


class ServerState:
    """The engine, the tokenizer, metrics, and the admission count, shared by all requests."""

    def __init__(self, engine: Any, config: ServerConfig):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = config
        self.metrics = Metrics(config.served_model_name)
        self.metrics.start_from(engine.stats())  # the warm-up's work is not the server's
        self.in_flight = 0  # sequences (requests x n) admitted and not yet finished
        self.draining = False
        self.created = int(time.time())

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_n(self, n: int | None) -> None:
        """`n` within the server's bound, checked before anything is made per completion."""
        if isinstance(n, int) and n > self.config.max_n:
            raise APIError(400, f"n must be at most {self.config.max_n} (the server's --max-n), got {n}", param="n")

    def admit(self, num_seqs: int, param: str = "n") -> "_Admission":
        """Counts `num_seqs` sequences in (a 429 when the queue is full; a 400 naming `param` when
        one request asks for more than MAX_REQUEST_SEQS)."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if num_seqs > MAX_REQUEST_SEQS:
            raise APIError(400, f"this request asks for {num_seqs} completions (prompts x n); one request may ask "
                                f"for at most {MAX_REQUEST_SEQS}", param=param)
        limit = self.config.max_num_seqs + self.config.max_waiting
        if self.in_flight and self.in_flight + num_seqs > limit:
            raise APIError(429, f"the waiting queue is full ({self.in_flight} sequences in flight, limit {limit}); "
                                "retry later", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight += num_seqs
        return _Admission(self, num_seqs)


class _Admission:
    def __init__(self, state: ServerState, num_seqs: int):
        self.state, self.num_seqs = state, num_seqs

    def release(self) -> None:
        if self.num_seqs:
            self.state.in_flight -= self.num_seqs
            self.num_seqs = 0


async def released_after(stream, admission: _Admission):
    """Yields from a response stream, then frees the stream's admission (however it ends)."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        admission.release()


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----- parameters -----

def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise APIError(400, f"{param} is empty: give at least one token", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} in {param} is outside the vocabulary [0, {vocab_size})", param=param)


def resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int, *,
                       param: str, prompt_param: str, allow_zero: bool) -> int:
    """The number of new tokens to allow; a request that cannot fit the context is a 400."""
    if max_tokens is not None and max_tokens < (0 if allow_zero else 1):
        floor = "0" if allow_zero else "1"
        raise APIError(400, f"{param} must be at least {floor}, got {max_tokens}", param=param)
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"prompt has {num_prompt_tokens} tokens, which leaves no room for a completion. "
                            f"Please reduce the length of the prompt.", param=prompt_param)
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                            f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt "
                            f"or {param}.", param=param)
    return max_tokens


def sampling_params(req: Any, state: "ServerState", *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None, structured_outputs: Any = None) -> SamplingParams:
    """SamplingParams from the fields both endpoints share, the server's defaults where a field is
    left out; invalid values are a 400."""
    vocab_size, defaults = state.vocab_size, {**NEUTRAL_SAMPLING, **state.config.sampling_defaults}
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        bad = [k for k in logit_bias if not 0 <= k < vocab_size]
        if bad:
            raise APIError(400, f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
    def pick(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            n=pick(req.n, 1), max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=pick(req.temperature, defaults["temperature"]), top_p=pick(req.top_p, defaults["top_p"]),
            top_k=pick(req.top_k, defaults["top_k"]), min_p=pick(req.min_p, defaults["min_p"]),
            presence_penalty=pick(req.presence_penalty, 0.0), frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, defaults["repetition_penalty"]), logit_bias=logit_bias,
            seed=req.seed,
            stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=structured_outputs)
    except InvalidInputError as err:
        raise APIError(400, str(err), param=str(err).split()[0]) from None


# ----- running engine requests -----

class EngineRequest:
    """One prompt's engine request, started (its first output is in) and timed for metrics (and
    for the request's trace, when tracing is on)."""

    def __init__(self, state: ServerState, request_id: str, prompt: dict, params: SamplingParams, arrival: float,
                 trace: Any = None, stream: bool = False):
        self.state = state
        self.request_id = request_id
        self.timer = RequestTimer(state.metrics, arrival, len(prompt["prompt_token_ids"]))
        # `weld.server.tracing.RequestTrace` when tracing is on
        self.timeline = (trace.engine_request(request_id, len(prompt["prompt_token_ids"]), params)
                         if trace is not None else None)
        self._gen = state.engine.generate(prompt, params, request_id, stream=stream)
        self._first: RequestOutput | None = None

    async def start(self) -> None:
        """Waits for the first output, so a request the engine refuses fails before any response."""
        try:
            self._first = self._observe(await self._gen.__anext__())
        except InvalidInputError as err:
            raise APIError(400, str(err)) from None

    def _observe(self, out: RequestOutput) -> RequestOutput:
        """Times an output; a completion that ended in an engine fault (finish_reason "error":
        non-finite logits) fails the whole request with a 500, its siblings aborted."""
        now = time.monotonic()
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        first_step_start = self.state.engine.first_step_start(self.request_id)
        self.timer.on_output(now, num_tokens, first_step_start)
        if self.timeline is not None:
            self.timeline.on_output(now, out, num_tokens, first_step_start)
        failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
        if out.finished or failed is not None:
            self.timer.on_finish(now, "error" if failed is not None else out.outputs[0].finish_reason)
        if failed is not None:
            raise APIError(500, f"{failed.stop_reason}; the request was ended", code="internal_error")
        return out

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
            if first.finished:
                return
        async for out in self._gen:
            yield self._observe(out)

    async def close(self) -> None:
        """Aborts the request if it is still running (leaving the engine's stream does)."""
        self.timer.on_finish(time.monotonic(), "abort")  # no-op when it had finished
        await self._gen.aclose()


async def start_all(requests: list[EngineRequest]) -> None:
    """Starts every request concurrently; if one fails, all are closed and the error raised."""
    results = await asyncio.gather(*(r.start() for r in requests), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(requests)
        raise errors[0]


async def close_all(requests: list[EngineRequest]) -> None:
    for r in requests:
        await r.close()


async def merged(requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all requests as they come; leaving early aborts the rest."""
    if len(requests) == 1:
        try:
            async for out in requests[0].outputs():
                yield 0, out
        finally:
            await close_all(requests)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, request: EngineRequest) -> None:
        try:
            async for out in request.outputs():
                queue.put_nowait((i, out))
        except Exception as err:
            queue.put_nowait((i, err))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(requests)


async def unless_disconnected(raw_request: Any, coro: Any, poll_s: float = 0.25) -> Any:
    """Runs `coro`; if the client goes away first, cancels it (aborting its engine requests)
    and returns None."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await raw_request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None


# ----- streaming text and logprobs -----

class StreamCursor(TextCursor):
    """A stream's place in one completion: the text sent (`TextCursor`, with its stop-string
    holdback), the tokens sent, and whether it began and ended."""

    def __init__(self, params: SamplingParams):
        super().__init__(params.stop)
        self.sent_tokens = 0
        self.started = False  # a chunk went out (for echo and the chat role)
        self.finished = False  # the chunk with the finish reason went out

    def token_range(self, num_tokens: int) -> tuple[int, int]:
        start, self.sent_tokens = self.sent_tokens, num_tokens
        return start, num_tokens


def _lp(value: float) -> float:
    return max(float(value), _MIN_LOGPROB)


def _token_text(tokenizer: Any, token_id: int, position: PositionLogprobs | None) -> str:
    entry = position.get(token_id) if position else None
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Any, token_ids: list[int], positions: list[PositionLogprobs | None],
                        text_offset: int) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset.

    A position without logprobs (the first prompt token) has None for its logprob and top."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        text = _token_text(tokenizer, token_id, position)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(position[token_id].logprob))
        top = {}
        for tid, entry in sorted(position.items(), key=lambda kv: kv[1].rank or 0):
            top.setdefault(_token_text(tokenizer, tid, position), _lp(entry.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Any, token_ids: list[int], positions: list[PositionLogprobs], num_top: int) -> dict:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": None}."""
    content = []
    for token_id, position in zip(token_ids, positions):
        text = _token_text(tokenizer, token_id, position)
        ranked = sorted((e.rank, tid, e) for tid, e in position.items() if e.rank is not None and e.rank <= num_top)
        top = [{"token": _token_text(tokenizer, tid, position), "logprob": _lp(e.logprob),
                "bytes": list(tokenizer.token_bytes(tid))} for _, tid, e in ranked[:num_top]]
        content.append({"token": text, "logprob": _lp(position[token_id].logprob),
                        "bytes": list(tokenizer.token_bytes(token_id)), "top_logprobs": top})
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens read from
    the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(data: Any) -> str:
    import json

    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(err: Exception) -> str:
    """An error after the stream began: one `data:` event with the OpenAI error body, then [DONE]."""
    api = err if isinstance(err, APIError) else APIError(500, f"{type(err).__name__}: {err}")
    return sse(api.body()) + SSE_DONE
