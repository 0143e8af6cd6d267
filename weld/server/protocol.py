"""Request bodies of the OpenAI API (plus the vLLM extras clients send), validated strictly.

Every model forbids unknown fields, so a field weld does not implement is a 400 that names it,
never silently ignored. Types are strict (a string is not a number). Fields accepted but without
effect here: `user`, `metadata`, `store: false`, `service_tier`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weld.server.errors import APIError

# Bounds on what a request's lists may hold, checked before anything is made from them (the
# prompt's tokens are then bounded by the context). OpenAI's own limit on tools is 128.
MAX_MESSAGES = 4096
MAX_TOOLS = 128
_ECHO_CHARS = 200  # of a bad value, quoted back in the error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # accepted, without effect on generation
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    store: bool | None = False


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class ChatMessage(_Strict):
    """One chat message, as the OpenAPI document describes it (the handler normalizes messages
    itself, naming the field of any problem: `chat.normalize_messages`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


# each POST route's request body, for the OpenAPI document (`openapi_schema`)
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def openapi_schema(base: dict) -> dict:
    """`base` (FastAPI's document of the routes, which read their bodies themselves) with every
    POST route's request body described by its model, so clients and schema-driven fuzzers see
    every field."""
    components = base.setdefault("components", {}).setdefault("schemas", {})
    message = ChatMessage.model_json_schema(ref_template="#/components/schemas/{model}")
    components["ChatMessage"] = message
    for path, model in REQUEST_BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        if "messages" in schema.get("properties", {}):
            schema["properties"]["messages"]["items"] = {"$ref": "#/components/schemas/ChatMessage"}
        components[model.__name__] = schema
        base["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return base


def _param_of(loc: tuple) -> str:
    """'messages.0.content' from pydantic's loc, leaving out the union-branch labels it adds."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in
                                                              ("str", "int", "float", "bool", "function-after"))]
    return ".".join(parts)


def parse_body(model: type[_Strict], body: Any) -> Any:
    """Validates a decoded JSON body against `model`; any problem is a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        errors = err.errors()
        extra = [_param_of(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
        if extra:
            raise APIError(400, f"unsupported field{'s' if len(extra) > 1 else ''}: {', '.join(extra)}",
                           param=extra[0]) from None
        missing = [_param_of(e["loc"]) for e in errors if e["type"] == "missing"]
        if missing:
            raise APIError(400, f"missing required field: {missing[0]}", param=missing[0]) from None
        first = errors[0]
        param = _param_of(first["loc"])
        got = repr(first.get("input"))
        if len(got) > _ECHO_CHARS:
            got = got[:_ECHO_CHARS] + "..."
        raise APIError(400, f"invalid value for {param}: {first['msg']} (got {got})", param=param) from None
