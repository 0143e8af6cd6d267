"""POST /v1/completions: raw prompts (text, token ids, or lists of either), streaming or not.

`echo` with `logprobs` returns the prompt tokens' logprobs before the completion's, the first
prompt token's as null: the loglikelihood contract lm-eval's OpenAI client relies on (it sends
token ids, `echo: true`, `logprobs: 1` and a `max_tokens` of 0 or 1).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from weld.server.errors import APIError
from weld.server.protocol import CompletionRequest
from weld.server.serving import (SSE_DONE, EngineRequest, ServerState, StreamCursor, check_token_ids,
                                 completion_logprobs, stream_error,
                                 merged, random_id, released_after, resolve_max_tokens, sampling_params, sse,
                                 start_all, unless_disconnected, usage)
from weld.server.structured_outputs import engine_structured_outputs, parse_structured_outputs


def _prompts(state: ServerState, req: CompletionRequest) -> list[dict]:
    """Each prompt as {"prompt": text, "prompt_token_ids": ids}."""
    raw = req.prompt
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raw = [raw]
    if not raw:
        raise APIError(400, "prompt is empty", param="prompt")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            ids = state.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            if not ids:
                raise APIError(400, "prompt is empty: it has no tokens", param="prompt")
            prompts.append({"prompt": item, "prompt_token_ids": ids})
        else:
            check_token_ids(item, state.vocab_size, "prompt")
            prompts.append({"prompt": None, "prompt_token_ids": list(item)})
    return prompts


def _echo_text(state: ServerState, prompt: dict) -> str:
    if prompt["prompt"] is None:
        prompt["prompt"] = state.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)
    return prompt["prompt"]


async def create_completion(state: ServerState, body: Any, raw_request: Any, trace: Any = None):
    """`trace`: the request's `weld.server.tracing.RequestTrace` when tracing is on."""
    from weld.server.protocol import parse_body

    req: CompletionRequest = parse_body(CompletionRequest, body)
    state.check_model(req.model)
    state.check_n(req.n)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
    if not req.stream and req.stream_options is not None:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    structured = engine_structured_outputs(parse_structured_outputs(req.response_format, req.structured_outputs))
    arrival = time.monotonic()
    prompts = _prompts(state, req)
    max_tokens = [resolve_max_tokens(req.max_tokens, len(p["prompt_token_ids"]), state.config.max_model_len,
                                     param="max_tokens", prompt_param="prompt", allow_zero=bool(req.echo))
                  for p in prompts]
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else req.prompt_logprobs
    params = [sampling_params(req, state, max_tokens=m, logprobs=req.logprobs,
                              prompt_logprobs=prompt_logprobs, structured_outputs=structured) for m in max_tokens]
    completion_id = random_id("cmpl")
    created = int(time.time())
    admission = state.admit(len(prompts) * n, param="prompt" if len(prompts) > 1 else "n")
    if trace is not None:
        trace.response_id = completion_id
    requests = [EngineRequest(state, f"{completion_id}-{i}", p, sp, arrival, trace, stream=bool(req.stream))
                for i, (p, sp) in enumerate(zip(prompts, params))]
    try:
        if req.stream:
            await start_all(requests)
            stream = _stream(state, req, prompts, params, requests, completion_id, created, n)
            return StreamingResponse(released_after(stream, admission), media_type="text/event-stream")
        result = await unless_disconnected(raw_request, _collect(state, req, prompts, requests, completion_id,
                                                                 created, n))
        return JSONResponse(result) if result is not None else JSONResponse({}, status_code=499)
    except BaseException:
        admission.release()
        raise
    finally:
        if not req.stream:
            admission.release()


async def _collect(state, req, prompts, requests, completion_id, created, n) -> dict:
    await start_all(requests)
    final: dict[int, Any] = {}
    async for i, out in merged(requests):
        if out.finished:
            final[i] = out
    choices = []
    completion_tokens = 0
    for i, prompt in enumerate(prompts):
        out = final[i]
        for c in out.outputs:
            text, logprobs = c.text, None
            echo = _echo_text(state, prompt) if req.echo else ""
            if req.logprobs is not None:
                ids, positions = [], []
                if req.echo:
                    ids += out.prompt_token_ids
                    positions += list(out.prompt_logprobs or [None] * len(ids))
                ids += c.token_ids
                positions += list(c.logprobs or [])
                logprobs = completion_logprobs(state.tokenizer, ids, positions, 0)
            completion_tokens += len(c.token_ids)
            choices.append({"index": i * n + c.index, "text": echo + text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    cached = sum(out.num_cached_tokens for out in final.values())
    return {"id": completion_id, "object": "text_completion", "created": created,
            "model": state.config.served_model_name, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached)}


async def _stream(state, req, prompts, params, requests, completion_id, created, n):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    cursors = {(i, j): StreamCursor(params[i]) for i in range(len(prompts)) for j in range(n)}
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    tokens_so_far: dict[tuple[int, int], int] = {}
    cached: dict[int, int] = {}  # per prompt
    model = state.config.served_model_name

    def chunk(choices, usage_value=None, with_usage=False):
        body = {"id": completion_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices}
        if with_usage:
            body["usage"] = usage_value
        return sse(body)

    try:
        async for i, out in merged(requests):
            cached[i] = out.num_cached_tokens
            for c in out.outputs:
                cursor = cursors[(i, c.index)]
                text = cursor.text_delta(c.text, c.finish_reason is not None)
                start, end = cursor.token_range(len(c.token_ids))
                logprobs = None
                prefix = ""
                ids, positions = [], []
                if req.echo and not cursor.started:
                    prefix = _echo_text(state, prompts[i])
                    ids += out.prompt_token_ids
                    positions += list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                if req.logprobs is not None:
                    ids += c.token_ids[start:end]
                    positions += list((c.logprobs or [])[start:end])
                    logprobs = completion_logprobs(state.tokenizer, ids, positions, 0)
                tokens_so_far[(i, c.index)] = len(c.token_ids)
                if not (prefix or text or c.finish_reason or (logprobs and logprobs["tokens"])):
                    continue
                if cursor.finished:
                    continue
                cursor.started = True
                cursor.finished = c.finish_reason is not None
                choice = {"index": i * n + c.index, "text": prefix + text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                yield chunk([choice], usage(prompt_tokens, sum(tokens_so_far.values()), sum(cached.values()))
                            if continuous else None, with_usage=include_usage)
        if include_usage:
            yield chunk([], usage(prompt_tokens, sum(tokens_so_far.values()), sum(cached.values())), with_usage=True)
        yield SSE_DONE
    except Exception as err:  # the headers are sent: report in the stream, as vLLM does
        yield stream_error(err)
