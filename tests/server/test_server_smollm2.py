"""`weld serve` on the bundled SmolLM2-135M-Instruct (real weights, real chat template): the API
key, the 429 limit, SIGTERM, and (slow) greedy parity and prompt logprobs against the `LLM` API.

Real weights decode slowly enough that a request is surely still in flight while the test acts."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest

from tests.server.conftest import run_server, wait_for
from weld import LLM, SamplingParams
from weld.utils.interrupts import exit_status

KEY = "sk-test-weld"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # max-num-seqs 2 + max-waiting 0: a third sequence in flight is refused with a 429
    with run_server("--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2",
                    "--max-waiting", "0", "--steps-per-call", "4", "--kv-cache-memory-gb", "0.1",
                    "--allowed-origins", '["http://good.example"]', tmp_path=tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.1, steps_per_call=4)


def test_api_key(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.get(server.url + "/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # only health stays open
    for path in ("/metrics", "/version", "/docs", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"


def test_cors_lets_in_only_the_allowed_origins(server):
    """--allowed-origins: a browser's preflight from that origin is answered (before the key
    check: it carries no key); another origin gets no CORS grant."""
    def preflight(origin):
        return httpx.options(server.url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
    good = preflight("http://good.example")
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "http://good.example"
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers


@pytest.mark.slow  # loads and compiles SmolLM2 a second time, in this process
def test_chat_matches_llm(client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24,
                                          temperature=0)
    assert resp.choices[0].message.content == ref.text and "Paris" in ref.text
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text


@pytest.mark.slow  # loads and compiles SmolLM2 a second time, in this process
def test_echo_logprobs_match_llm(client, llm):
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = llm.tokenizer.encode(prompt)
    ref = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, echo=True,
                                     logprobs=1, temperature=0)
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(
        [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0], abs=1e-3)
    assert resp.choices[0].text == prompt + ref.outputs[0].text


def test_full_queue_gets_429(server):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 200, "n": 2,
            "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=120, headers=headers) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # keep it: a dropped iterator closes the connection (an abort)
            next(line for line in lines if line.startswith("data: "))
            refused = http.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
            assert int(refused.headers["retry-after"]) >= 1  # clients (openai's own) back off by it
        ok = wait_for(lambda: http.post(server.url + "/v1/completions",
                                        json={"prompt": "Hi", "max_tokens": 2}).status_code == 200, timeout=60)
        assert ok  # once the stream is gone, requests are admitted again


def test_sigterm_finishes_requests_in_flight(server):
    """Runs last in this module: the server exits."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not chunks:
                    server.proc.send_signal(signal.SIGTERM)
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    finals = [json.loads(c)["choices"][0] for c in chunks[:-1]]
    assert finals[-1]["finish_reason"] == "length"  # it ran to the end, not aborted
    assert server.proc.wait(60) == exit_status(signal.SIGTERM)  # 143, as the shell reports a SIGTERM
    assert "Traceback" not in server.logs()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
