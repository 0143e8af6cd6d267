"""Tool calls through the server, on a tiny random llama with a Hermes-style tool template.

A random model does not call tools by itself, so these tests steer it: whole tool-call texts are
single tokens of this model's tokenizer (see conftest.TOOL_TOKENS) and `logit_bias` makes the
model pick one. The server still has to find the call in the generated text, shape it, stream
it, and render the follow-up conversation. Parsing itself is unit-tested on text in
tests/tokenizer/test_tool_parsers.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import CALL_FULL, run_server
from weld import LLM, SamplingParams

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_tool_model_dir, tmp_path_factory):
    with run_server("--model", str(tiny_tool_model_dir), "--max-model-len", "1024", "--kv-cache-memory-gb", "0.02",
                    "--steps-per-call", "4", "--served-model-name", "tools",
                    tmp_path=tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def token_of(server):
    def get(text):
        ids = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert len(ids) == 1, (text, ids)
        return ids[0]
    return get


def _chat(client, bias_token, **kw):
    return client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, temperature=0,
                                          logit_bias={str(bias_token): 100}, **kw)


def _streamed_calls(stream):
    """Accumulates streamed tool-call deltas the way OpenAI clients do."""
    calls, content, finish = {}, "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


def test_auto_tool_call(client, token_of):
    resp = _chat(client, token_of(CALL_FULL), max_tokens=1)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_tool_call_streaming_and_parallel(client, token_of):
    calls, content, finish = _streamed_calls(_chat(client, token_of(CALL_FULL), max_tokens=1, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    # two calls, produced in one fused engine step (steps_per_call 4): both come out, in order
    calls, _, finish = _streamed_calls(_chat(client, token_of(CALL_FULL), max_tokens=2, stream=True))
    assert finish == "tool_calls" and len(calls) == 2 and calls[0]["id"] != calls[1]["id"]
    resp = _chat(client, token_of(CALL_FULL), max_tokens=2)
    assert len(resp.choices[0].message.tool_calls) == 2
    resp = _chat(client, token_of(CALL_FULL), max_tokens=2, parallel_tool_calls=False)
    assert len(resp.choices[0].message.tool_calls) == 1
    calls, _, _ = _streamed_calls(_chat(client, token_of(CALL_FULL), max_tokens=2, stream=True,
                                        parallel_tool_calls=False))
    assert len(calls) == 1


def test_tool_choice_none_leaves_text_alone(client, token_of):
    resp = _chat(client, token_of(CALL_FULL), max_tokens=1, tool_choice="none")
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content == CALL_FULL and resp.choices[0].finish_reason == "length"


def test_tool_choice_errors(client):
    bad = [{"tool_choice": {"type": "function", "function": {"name": "nope"}}},
           {"tool_choice": "sometimes"}]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, **kw)
        assert info.value.body["param"] == "tool_choice"


def test_round_trip(client, server, token_of, tiny_tool_model_dir):
    first = _chat(client, token_of(CALL_FULL), max_tokens=1)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
    ]
    answer = client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, max_tokens=8,
                                            temperature=0, tool_choice="none")
    # the conversation reached the template: the call went back in as an object, the result as a tool turn
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    llm = LLM(model=str(tiny_tool_model_dir), max_model_len=1024, kv_cache_memory_gb=0.02)
    template_messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    text = llm.tokenizer.apply_chat_template(template_messages, tools=TOOLS, add_generation_prompt=True)
    assert "<tool_response>\nSunny, 21 C.\n</tool_response>" in text and CALL_FULL in text
    assert rendered["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    assert answer.usage.prompt_tokens == rendered["count"]
    ref = llm.chat(template_messages, SamplingParams(max_tokens=8, temperature=0), tools=TOOLS)[0].outputs[0]
    assert answer.choices[0].message.content == ref.text
    stream = client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, max_tokens=8,
                                            temperature=0, tool_choice="none", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text


WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
                {"type": "function", "function": {"name": "get_time", "parameters": {
                    "type": "object", "additionalProperties": False, "required": ["zone"],
                    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_are_grammar_constrained(client, choice):
    """Unsteered, the random model would write garbage; under a forced tool choice its call must
    name one of the tools and carry arguments valid for that tool's schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    for seed in (0, 1, 2):
        resp = client.chat.completions.create(model="tools", messages=ASK, tools=FORCED_TOOLS, tool_choice=choice,
                                              temperature=1.0, seed=seed, max_tokens=200)
        assert resp.choices[0].finish_reason == "tool_calls", resp.choices[0]
        (call,) = resp.choices[0].message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        stream = client.chat.completions.create(model="tools", messages=ASK, tools=FORCED_TOOLS, tool_choice=choice,
                                                temperature=1.0, seed=seed, max_tokens=200, stream=True)
        calls, _, finish = _streamed_calls(stream)
        assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [(call.function.name, json.loads(call.function.arguments))]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_cut_by_max_tokens_is_a_partial_call(client, choice):
    """A forced call that runs into max_tokens comes back as tool_calls with the partial
    arguments and finish_reason "length", never as raw call JSON in content; the streamed deltas
    concatenate to exactly the same name and arguments."""
    reasons = []
    for seed, max_tokens in ((0, 4), (1, 7), (2, 10)):
        kwargs = dict(model="tools", messages=ASK, tools=FORCED_TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                      max_tokens=max_tokens)
        resp = client.chat.completions.create(**kwargs)
        choice0 = resp.choices[0]
        reasons.append(choice0.finish_reason)
        (call,) = choice0.message.tool_calls
        assert choice0.message.content is None
        if choice0.finish_reason == "length":
            with pytest.raises(ValueError):
                json.loads(call.function.arguments)  # cut short: not a whole JSON value
        else:
            assert choice0.finish_reason == "tool_calls"
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        calls, content, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        assert content == "" and finish == choice0.finish_reason
        assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert "length" in reasons  # the cut case ran


def test_forced_call_arguments_are_compact_json(client):
    """No free whitespace between the arguments' JSON tokens: exactly the canonical ", " and ": "
    separators (before, a random model filled calls with newlines until max_tokens)."""
    for seed in (0, 1, 2):
        resp = client.chat.completions.create(model="tools", messages=ASK, tools=FORCED_TOOLS, tool_choice="required",
                                              temperature=1.0, seed=seed, max_tokens=200)
        arguments = resp.choices[0].message.tool_calls[0].function.arguments
        assert json.dumps(json.loads(arguments), ensure_ascii=False) == arguments
