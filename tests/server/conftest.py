"""Server fixtures: `weld serve` as a real uvicorn subprocess on 127.0.0.1, and tiny models for it.

Each test module starts one server (module-scoped) and talks to it with the official `openai`
client or `httpx`. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import CORPUS, make_tiny_hf_model

# Tool-call texts that the tool model's tokenizer holds as single (non-special) tokens, so a test
# can make the random model write a whole call by biasing one token (logit_bias), and the server
# must still find it in the output text. The tool parser itself is unit-tested on text.
CALL_FULL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_AFTER_NAME = 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'  # tool_choice required
CALL_AFTER_ARGUMENTS_KEY = '{"city": "Paris"}}\n</tool_call>'  # tool_choice named
TOOL_TOKENS = (CALL_FULL, CALL_AFTER_NAME, CALL_AFTER_ARGUMENTS_KEY)

# A Hermes / Qwen-style chat template with tools, written for these tests.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'system' %}
{%- elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant
{{ m['content'] }}{% for c in m['tool_calls'] %}<tool_call>
{"name": "{{ c['function']['name'] }}", "arguments": {{ c['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _make_tool_tokenizer(directory: pathlib.Path) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = CORPUS + HERMES_TEMPLATE * 5 + ' {"type": "function", "function": {"name": "get_weather", ' \
        '"description": "Current weather", "parameters": {"type": "object", "properties": {"city": ' \
        '{"type": "string"}}, "required": ["city"]}}} Sunny, 21 C. ' * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": HERMES_TEMPLATE}))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def tiny_tool_model_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random llama with a Hermes-style tool template; TOOL_TOKENS are single tokens."""
    d = tmp_path_factory.mktemp("tiny-tool-llama")
    vocab = _make_tool_tokenizer(d)
    make_tiny_hf_model("llama", d, seed=5, vocab_size=vocab, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                       max_position_embeddings=1024)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: pathlib.Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def metric(self, name: str, client: httpx.Client | None = None) -> float:
        """The value of one unlabelled-but-model_name Prometheus sample, e.g. 'weld:kv_cache_usage_perc'."""
        text = (client or httpx).get(self.url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not in /metrics")


@contextlib.contextmanager
def run_server(*args: str, tmp_path: pathlib.Path, timeout: float = 240.0):
    """Starts `weld serve ARGS` on a free port and waits (bounded) until /health answers."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    env = {**os.environ, "WELD_PROGRESS": "0", "JAX_PLATFORMS": "cpu"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "weld.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weld serve exited with {proc.returncode}:\n{server.logs()}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"weld serve did not become healthy in {timeout} s:\n{server.logs()}")
            time.sleep(0.25)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2):
    """Polls `predicate` until it is true or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
