"""Faults seen from a client: a request whose logits turn NaN gets a 500 (an error event when
streaming) while its neighbours finish as if alone and the server stays healthy; an engine thread
that dies fails the open requests, turns /health to 503 and stops the server with status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest

from tests.server.conftest import free_port, run_server, wait_for

CLEAN = "The quick brown fox"


@pytest.fixture(scope="module")
def server(nan_token_model, tmp_path_factory):
    directory, _ = nan_token_model
    with run_server("--model", str(directory), "--dtype", "float32", "--max-model-len", "128",
                    "--served-model-name", "nan", tmp_path=tmp_path_factory.mktemp("faults")) as s:
        yield s


def _body(prompt: str, **extra) -> dict:
    return {"model": "nan", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}


def test_nan_request_fails_alone(server, nan_token_model):
    _, poison = nan_token_model
    url = server.url + "/v1/completions"
    solo = httpx.post(url, json=_body(CLEAN), timeout=60).json()["choices"][0]["text"]
    bias = {"logit_bias": {str(poison): 100}}
    results = {}

    def post(name, body):
        results[name] = httpx.post(url, json=body, timeout=60)

    threads = [threading.Thread(target=post, args=(name, body)) for name, body in
               [("clean", _body(CLEAN)), ("nan", _body(CLEAN, **bias)), ("nan_n2", _body(CLEAN, n=2, **bias))]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert results["clean"].status_code == 200 and results["clean"].json()["choices"][0]["text"] == solo
    for name in ("nan", "nan_n2"):
        r = results[name]
        assert r.status_code == 500, r.text
        assert "non-finite logits" in r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"
    # streamed: the error arrives as an event, then [DONE]
    with httpx.stream("POST", url, json=_body(CLEAN, stream=True, **bias), timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "non-finite logits" in json.loads(events[-2])["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.post(url, json=_body(CLEAN), timeout=60).json()["choices"][0]["text"] == solo
    assert wait_for(lambda: server.metric("weld:num_requests_running") == 0)
    assert server.metric("weld:kv_cache_usage_perc") == 0


ENGINE_DIES = textwrap.dedent("""
    import sys
    from weld.engine.async_llm import AsyncLLM
    from weld.server.app import serve
    from weld.server.serving import ServerConfig

    engine = AsyncLLM(model=sys.argv[1], dtype="float32", max_model_len=64, progress=False)
    def broken_step():
        raise RuntimeError("a planted fault")
    engine.engine.step = broken_step
    sys.exit(serve(engine, ServerConfig(served_model_name="m", max_model_len=64), port=int(sys.argv[2]),
                   log_level="warning"))
""")


def test_engine_thread_death_stops_the_server(tiny_llama_dir, tmp_path):
    directory, _ = tiny_llama_dir
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WELD_PROGRESS": "0"}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_DIES, str(directory), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def healthy():
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None
        assert wait_for(healthy, timeout=120) and proc.poll() is None
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code in (500, 503) and "engine" in r.json()["error"]["message"]
        _, err = proc.communicate(timeout=30)  # the server stops by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1
    assert "weld: error: the engine thread died (RuntimeError: a planted fault); stopping the server" in err
