"""Schema-driven fuzzing of the HTTP API (schemathesis, from the server's own /openapi.json):
every route, request bodies generated from the documented models, each answered without a
server error (5xx) and with a JSON body of the documented shape; the server keeps serving.
Bounded: a few dozen examples per route against the tiny model."""

from __future__ import annotations

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from tests.server.conftest import run_server

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir, tmp_path_factory):
    directory, _ = tiny_llama_dir
    with run_server("--model", str(directory), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb", "0.02",
                    "--steps-per-call", "4", "--served-model-name", "tiny", "--max-n", "4",
                    tmp_path=tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def _check(case, response):
    case.validate_response(response, checks=(not_a_server_error,))
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: a list per header
    if case.path != "/metrics" and content_type.startswith("application/json"):
        body = response.json()
        assert isinstance(body, dict)
        if response.status_code >= 400:  # OpenAI-shaped errors
            assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])


def test_no_server_errors(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")}
    for operation in operations:
        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(max_examples=25, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def run(case):
            _check(case, case.call(timeout=120))

        run()


def test_server_still_serves_after_fuzzing(fuzz_server):
    ok = httpx.post(fuzz_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
