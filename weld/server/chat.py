"""POST /v1/chat/completions: messages through the model's chat template, tools, streaming.

Tool calls are read from the reply by `weld.tokenizer.tool_parsers` (Hermes / Qwen `<tool_call>`
blocks, or a bare JSON object). `tool_choice`:
- "none": the tools are shown to the template, the reply is never read as a call;
- "auto" (the default with tools): the reply is parsed; calls found become `tool_calls`;
- "required" / a named function: the assistant turn is started with the opening of a call
  (`<tool_call>\\n{"name": "` or `...{"name": "NAME", "arguments": ` for templates that use
  `<tool_call>`, the bare JSON opening otherwise), and the model writes the rest under a
  grammar (structured outputs): a tool's name, then arguments valid for its parameters schema.
With `parallel_tool_calls: false` only the first call is kept.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from weld.engine.sampling_params import StructuredOutputsParams
from weld.server.errors import APIError
from weld.server.protocol import ChatCompletionRequest, parse_body
from weld.server.serving import (SSE_DONE, EngineRequest, ServerState, StreamCursor, chat_logprobs,
                                 merged, random_id, released_after, resolve_max_tokens, sampling_params, sse, start_all,
                                 stream_error, unless_disconnected, usage)
from weld.server.structured_outputs import engine_structured_outputs, parse_structured_outputs
from weld.tokenizer.tool_parsers import TOOL_CALL_OPEN, ParsedToolCall, ToolCallStreamParser, parse_tool_calls
from weld.utils.errors import InvalidInputError

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "reasoning",
                 "reasoning_content"}
_RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "continue_final_message"}


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"unsupported content part {kind!r} in {where}.content.{k}: only text parts "
                                    f"are supported", param=f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: text content, `developer` as `system`, tool-call
    arguments as objects (templates write them with `tojson`)."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role")
        if role not in _ROLES:
            raise APIError(400, f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}", param=f"{where}.role")
        unknown = set(message) - _MESSAGE_KEYS
        if unknown:
            raise APIError(400, f"unsupported field in {where}: {sorted(unknown)[0]}", param=where)
        m = {"role": "system" if role == "developer" else role, "content": _text_of(message.get("content"), where)}
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                m[key] = message[key]
        if message.get("tool_calls"):
            if role != "assistant" or not isinstance(message["tool_calls"], list):
                raise APIError(400, f"{where}.tool_calls must be a list on an assistant message",
                               param=f"{where}.tool_calls")
            m["tool_calls"] = [_template_tool_call(call, f"{where}.tool_calls.{k}")
                               for k, call in enumerate(message["tool_calls"])]
        out.append(m)
    return out


def _template_tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                       param=where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # a template can still print the string
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tool_choice(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """('none' | 'auto' | 'required' | 'named', the named function)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
        return "none", None
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        return choice, None
    names = [t.function.name for t in req.tools]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
                       param="tool_choice")
    return "named", choice.function.name


def _call_opening(state: ServerState, mode: str, name: str | None) -> str:
    """The text the assistant turn starts with to steer the model into a call ('' for none/auto)."""
    if mode not in ("required", "named"):
        return ""
    hermes = TOOL_CALL_OPEN in (state.tokenizer.chat_template or "")
    opening = TOOL_CALL_OPEN + "\n" if hermes else ""
    if mode == "required":
        return opening + '{"name": "'
    return opening + '{"name": ' + json.dumps(name) + ', "arguments": '


def _forced_call_grammar(req: ChatCompletionRequest, mode: str, name: str | None, opening: str) -> StructuredOutputsParams:
    """The grammar the reply after `opening` must follow when a call is forced: the rest of one
    call object whose arguments match the called function's JSON schema (llguidance Lark with
    `%json` for each schema), up to the object's closing brace. The reply ends there: a Hermes
    `</tool_call>` is often a special token, which grammar text cannot produce, and the parser
    reads a call left open at the end. "required" lets the model pick any of the tools; a named
    choice fixes it. The arguments are compact JSON."""
    closing = json.dumps("}")
    # compact arguments (vLLM's disable_any_whitespace): no free whitespace between JSON tokens,
    # which random-ish models fill with newlines until max_tokens, and which costs tokens
    compact = {"x-guidance": {"whitespace_flexible": False}}
    schemas = {t.function.name: {**(t.function.parameters or {"type": "object"}), **compact} for t in req.tools}
    if mode == "named":
        return StructuredOutputsParams(grammar=f"start: args {closing}\nargs: %json {json.dumps(schemas[name])}")
    lines = ["start: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
    for i, (tool, schema) in enumerate(schemas.items()):
        head = json.dumps(json.dumps(tool)[1:] + ', "arguments": ')  # the name's closing quote onwards
        lines += [f"call_{i}: {head} args_{i} {closing}", f"args_{i}: %json {json.dumps(schema)}"]
    return StructuredOutputsParams(grammar="\n".join(lines))


def _api_tool_call(call: ParsedToolCall) -> dict:
    return {"id": random_id("chatcmpl-tool"), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


async def create_chat_completion(state: ServerState, body: Any, raw_request: Any, trace: Any = None):
    """`trace`: the request's `weld.server.tracing.RequestTrace` when tracing is on."""
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    state.check_model(req.model)
    state.check_n(req.n)
    if not req.stream and req.stream_options is not None:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true "
                            "(set add_generation_prompt: false)", param="continue_final_message")
    structured = engine_structured_outputs(parse_structured_outputs(req.response_format, req.structured_outputs))
    template_kwargs = dict(req.chat_template_kwargs or {})
    reserved = set(template_kwargs) & _RESERVED_TEMPLATE_VARS
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)[0]}", param="chat_template_kwargs")
    mode, named = _tool_choice(req)
    if structured is not None and mode in ("required", "named"):
        raise APIError(400, "a forced tool call (tool_choice required or named) cannot be combined with "
                            "response_format / structured_outputs", param="tool_choice")
    arrival = time.monotonic()
    messages = normalize_messages(req.messages)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tools=tools,
            continue_final_message=req.continue_final_message, **template_kwargs)
    except InvalidInputError as err:
        raise APIError(400, str(err), param="messages") from None
    opening = _call_opening(state, mode, named)
    text += opening
    if opening:
        try:
            structured = _forced_call_grammar(req, mode, named, opening)
        except InvalidInputError as err:  # a tool's parameters are not a usable JSON schema
            raise APIError(400, str(err).replace("structured_outputs.grammar", "tools"), param="tools") from None
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(max_tokens, len(ids), state.config.max_model_len,
                                    param="max_completion_tokens" if req.max_completion_tokens is not None
                                    else "max_tokens", prompt_param="messages", allow_zero=False)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, state, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=None,
                             structured_outputs=structured)
    completion_id = random_id("chatcmpl")
    created = int(time.time())
    admission = state.admit(params.n)
    if trace is not None:
        trace.response_id = completion_id
    request = EngineRequest(state, completion_id, {"prompt": text, "prompt_token_ids": ids}, params, arrival, trace,
                            stream=bool(req.stream))
    ctx = _ChatContext(state, req, params, completion_id, created, mode, opening, named)
    try:
        if req.stream:
            await start_all([request])
            return StreamingResponse(released_after(_stream(ctx, request), admission),
                                     media_type="text/event-stream")
        result = await unless_disconnected(raw_request, _collect(ctx, request))
        return JSONResponse(result) if result is not None else JSONResponse({}, status_code=499)
    except BaseException:
        admission.release()
        raise
    finally:
        if not req.stream:
            admission.release()


class _ChatContext:
    def __init__(self, state, req, params, completion_id, created, mode, opening, named=None):
        self.state, self.req, self.params = state, req, params
        self.completion_id, self.created = completion_id, created
        self.mode, self.opening, self.named = mode, opening, named
        self.parse_tools = mode != "none"
        self.num_top = req.top_logprobs or 0
        self.model = state.config.served_model_name


def _finish_reason(reason: str | None, called: bool, partial: bool = False) -> str | None:
    """A reply with whole calls is "tool_calls"; a forced call cut by max_tokens keeps "length"
    (its arguments are partial)."""
    return "tool_calls" if called and not partial and reason in ("stop", "length") else reason


def _forced_partial_call(ctx: "_ChatContext", text: str) -> ParsedToolCall:
    """The call a forced reply (tool_choice required or named) was writing when max_tokens cut
    it: the name as far as it got and the arguments' partial JSON text. `text` is what the model
    wrote after the opening; the grammar fixes its shape: (name's rest) `", "arguments": ` args."""
    if ctx.mode == "named":
        return ParsedToolCall(ctx.named, text)
    separator = '", "arguments": '
    name, _, arguments = text.partition(separator)
    return ParsedToolCall(name, arguments)


async def _collect(ctx: _ChatContext, request: EngineRequest) -> dict:
    await start_all([request])
    final = None
    async for _, out in merged([request]):
        final = out
    choices, completion_tokens = [], 0
    for c in final.outputs:
        completion_tokens += len(c.token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        calls: list[ParsedToolCall] = []
        partial = False
        if ctx.parse_tools:
            content, calls = parse_tool_calls(ctx.opening + c.text)
            partial = bool(ctx.opening) and not calls
            if partial:  # a forced call cut short: still a call, never raw JSON content
                content, calls = None, [_forced_partial_call(ctx, c.text)]
            if ctx.req.parallel_tool_calls is False:
                calls = calls[:1]
            if calls:
                message["content"] = content
                message["tool_calls"] = [_api_tool_call(call) for call in calls]
            else:
                message["content"] = ctx.opening + c.text
        logprobs = (chat_logprobs(ctx.state.tokenizer, c.token_ids, c.logprobs or [], ctx.num_top)
                    if ctx.req.logprobs else None)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": _finish_reason(c.finish_reason, bool(calls), partial),
                        "stop_reason": c.stop_reason})
    return {"id": ctx.completion_id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
            "choices": choices, "usage": usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens)}


class _ChoiceStream:
    """One choice's stream state: sent text, the tool-call parser, calls sent so far."""

    def __init__(self, ctx: _ChatContext):
        self.cursor = StreamCursor(ctx.params)
        self.parser = ToolCallStreamParser() if ctx.parse_tools else None
        self.ctx, self.text = ctx, ""  # the reply so far (a forced call cut short is rebuilt from it)
        self.num_calls = 0
        self.partial = False  # a forced call cut short
        self.keep_calls = 1 if ctx.req.parallel_tool_calls is False else None
        if self.parser is not None and ctx.opening:
            self.parser.feed(ctx.opening)  # held: it opens a call

    def deltas(self, text: str, finished: bool) -> list[dict]:
        if self.parser is None:
            return [{"content": text}] if text else []
        self.text += text
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
            if self.ctx.opening and self.num_calls == 0 and not any(kind == "tool_call" for kind, _ in events):
                events = [("tool_call", _forced_partial_call(self.ctx, self.text))]  # cut short: still a call
                self.partial = True
        out = []
        for kind, value in events:
            if kind == "content":
                out.append({"content": value})
            elif self.keep_calls is None or self.num_calls < self.keep_calls:
                call = _api_tool_call(value)
                out.append({"tool_calls": [{"index": self.num_calls, **call}]})
                self.num_calls += 1
        return out


async def _stream(ctx: _ChatContext, request: EngineRequest):
    req = ctx.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    choices = {j: _ChoiceStream(ctx) for j in range(ctx.params.n)}
    prompt_tokens = cached_tokens = 0
    generated: dict[int, int] = {}

    def chunk(choice_list, with_usage_value=None):
        body = {"id": ctx.completion_id, "object": "chat.completion.chunk", "created": ctx.created,
                "model": ctx.model, "choices": choice_list}
        if include_usage:
            body["usage"] = with_usage_value
        return sse(body)

    def current_usage():
        return usage(prompt_tokens, sum(generated.values()), cached_tokens) if continuous else None

    try:
        async for _, out in merged([request]):
            prompt_tokens, cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
            for c in out.outputs:
                s = choices[c.index]
                if s.cursor.finished:
                    continue
                generated[c.index] = len(c.token_ids)
                finished = c.finish_reason is not None
                if not s.cursor.started:
                    s.cursor.started = True
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}], current_usage())
                text = s.cursor.text_delta(c.text, finished)
                start, end = s.cursor.token_range(len(c.token_ids))
                logprobs = (chat_logprobs(ctx.state.tokenizer, c.token_ids[start:end], (c.logprobs or [])[start:end],
                                          ctx.num_top) if req.logprobs and end > start else None)
                deltas = s.deltas(text, finished)
                if logprobs is not None and not deltas:
                    deltas = [{"content": ""}]  # logprobs of tokens whose text is still held back
                for k, delta in enumerate(deltas):
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                  "finish_reason": None}], current_usage())
                if finished:
                    s.cursor.finished = True
                    yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                  "finish_reason": _finish_reason(c.finish_reason, s.num_calls > 0, s.partial),
                                  "stop_reason": c.stop_reason}], current_usage())
        if include_usage:
            body = {"id": ctx.completion_id, "object": "chat.completion.chunk", "created": ctx.created,
                    "model": ctx.model, "choices": [],
                    "usage": usage(prompt_tokens, sum(generated.values()), cached_tokens)}
            yield sse(body)
        yield SSE_DONE
    except Exception as err:  # the headers are sent: report in the stream, as vLLM does
        yield stream_error(err)
