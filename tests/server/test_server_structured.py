"""Structured outputs through `weld serve` (a real uvicorn subprocess) and the official `openai` client.

The model is the tiny random llama: unconstrained it writes garbage, so every output that
parses and validates was shaped by the grammar mask. Sampling is seeded (temperature 1), so the
outputs are reproducible; JSON whitespace is free (the OpenAI default), and the seeds used here
finish well inside max_tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.engine.test_structured import SCHEMAS
from tests.server.conftest import run_server, wait_for

MESSAGES = [{"role": "user", "content": "Give me JSON."}]
SEEDS = (2, 3)
MAX_TOKENS = 225


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    directory, _ = tiny_llama_dir
    with run_server("--model", str(directory), "--max-model-len", "256", "--kv-cache-memory-gb", "0.01",
                    "--steps-per-call", "4", "--served-model-name", "tiny",
                    tmp_path=tmp_path_factory.mktemp("srv-structured")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)


def test_json_schema_response_format_validates(client):
    """Five schemas (nested objects, enums, arrays, bounded numbers, required fields) x two
    seeds, sent concurrently so the engine batches them."""
    cases = [(name, seed) for name in SCHEMAS for seed in SEEDS]

    def ask(case):
        name, seed = case
        return client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, seed=seed,
            extra_body={"top_k": 0, "min_p": 0.0},  # plain sampling, as the seeds were chosen for
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                    "strict": True}})

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(ask, cases))
    for (name, seed), resp in zip(cases, responses):
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", (name, seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_streamed_json_schema_and_json_object(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enums"]}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["enums"])
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                          response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_structured_outputs_regex_choice_on_both_endpoints(client):
    regex = r"[0-9]{2}-[a-z]{3}"
    resp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=1.0,
                                     seed=1, n=2, extra_body={"structured_outputs": {"regex": regex}})
    for choice in resp.choices:
        assert re.fullmatch(regex, choice.text), choice.text
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0, seed=1,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert resp.choices[0].message.content in ("yes", "no", "maybe")
    assert resp.choices[0].finish_reason == "stop"
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"json": SCHEMAS["array"], "disable_any_whitespace": True}})
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS["array"])
    assert not re.search(r"\s", text)


@pytest.mark.parametrize("path,body,param", [
    ("chat/completions", {"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "a", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ("chat/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"json": '{"type": "object"', "regex": "a"}}, "structured_outputs"),
    ("chat/completions", {"response_format": {"type": "json_object"}, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tool_choice"),
])
def test_invalid_constraints_are_400(server, path, body, param):
    base = {"messages": MESSAGES} if path.startswith("chat") else {"prompt": "x"}
    resp = httpx.post(f"{server.url}/v1/{path}", json={**base, "max_tokens": 4, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # and the server keeps serving


def test_kv_cache_is_free_after_constrained_requests(server, client):
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=0,
                                   response_format={"type": "json_object"})
    assert wait_for(lambda: server.metric("weld:kv_cache_usage_perc") == 0.0, timeout=10)
