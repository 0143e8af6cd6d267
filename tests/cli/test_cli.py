"""The `weld` command line, run as a subprocess: help, a real generate and chat, and bad input; the
speculative decoding flags, parsed in-process."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from weld import cli
from weld.config import speculative_config_from_args
from weld.utils.errors import InvalidInputError, WeldError
from weld.weights import default_model_path


def weld(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WELD_PROGRESS": "0", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "weld.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str):
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weld: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_help():
    top = weld("--help")
    assert top.returncode == 0 and "generate" in top.stdout and "chat" in top.stdout
    gen = weld("generate", "--help")
    for flag in ("--model", "--dtype", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed"):
        assert flag in gen.stdout
    assert weld("chat", "--help").returncode == 0


def test_generate_streams_the_greedy_completion(tiny_llama_dir):
    from weld import LLM, SamplingParams

    directory, _ = tiny_llama_dir
    proc = weld("generate", "The quick brown fox", "--model", str(directory), "--max-tokens", "8",
                "--temperature", "0", "--max-model-len", "128")
    assert proc.returncode == 0, proc.stderr
    expected = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01).generate(
        "The quick brown fox", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert proc.stdout == expected + "\n"


CHAT_INPUT = "Paris\nThe quick brown fox\n/reset\nOnce upon a time\n/exit\nnever answered\n"


def test_chat_keeps_history(tiny_llama_dir):
    """`weld chat` on a tiny model, greedy: each reply equals LLM.chat's on the whole history so far
    (turn 1's user line and reply included), /reset keeps only the --system message, and /exit ends
    the session with status 0 before the next line is answered."""
    from weld import LLM, SamplingParams

    directory, _ = tiny_llama_dir
    system = {"role": "system", "content": "You are terse."}
    proc = weld("chat", "--model", str(directory), "--system", system["content"], "--max-tokens", "4",
                "--temperature", "0", "--max-model-len", "128", stdin=CHAT_INPUT)
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model=str(directory), max_model_len=128, kv_cache_memory_gb=0.01)

    def reply(*messages):
        return llm.chat(list(messages), SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text

    user = [{"role": "user", "content": text} for text in ("Paris", "The quick brown fox", "Once upon a time")]
    first = reply(system, user[0])
    second = reply(system, user[0], {"role": "assistant", "content": first}, user[1])
    third = reply(system, user[2])  # after /reset
    assert proc.stdout == f"{first}\n{second}\n{third}\n"
    # the comparison can tell: without its history (or without the system prompt) turn 2 reads otherwise
    assert second != reply(system, user[1]) and first != reply(user[0])


class ChatRecorder:
    """Stands in for LLM in `weld chat`: records every conversation the chat renders and every
    prompt it streams, and replies "reply N"."""

    def __init__(self):
        self.rendered: list[list[dict]] = []
        self.streamed: list[dict] = []
        self.tokenizer = self

    def apply_chat_template(self, messages, add_generation_prompt=False):
        assert add_generation_prompt
        self.rendered.append([dict(m) for m in messages])
        return json.dumps(messages)

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens  # the template already wrote them
        return [len(text)]

    def stream(self, prompt, params, on_text=None):
        self.streamed.append(prompt)
        if on_text is not None:
            on_text("reply ")  # as a device call's hand-over brings it
        else:
            yield "reply "
        yield str(len(self.streamed))


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_sends_the_whole_history_to_the_model(system, monkeypatch, capsys):
    import io

    recorder = ChatRecorder()
    monkeypatch.setattr(cli, "_make_llm", lambda args: recorder)
    monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT_INPUT))
    assert cli.main(["chat", "--temperature", "0"] + (["--system", system] if system else [])) == 0
    head = [{"role": "system", "content": system}] if system else []
    user = [{"role": "user", "content": text} for text in ("Paris", "The quick brown fox", "Once upon a time")]
    assert recorder.rendered == [
        head + user[:1],
        head + [user[0], {"role": "assistant", "content": "reply 1"}, user[1]],
        head + user[2:],  # /reset dropped the turns, not the system prompt; /exit: "never answered" is not
    ]
    assert recorder.streamed == [{"prompt": json.dumps(m), "prompt_token_ids": [len(json.dumps(m))]}
                                 for m in recorder.rendered]
    assert capsys.readouterr().out == "reply 1\nreply 2\nreply 3\n"


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
])
def test_bad_arguments(args, needle):
    assert_clean_error(weld("generate", "hello", *args), needle)


def test_bad_kernel_switch(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("WELD_CPU_KERNELS", "yes")
    assert_clean_error(weld("generate", "hello", "--model", str(tiny_llama_dir[0])), "WELD_CPU_KERNELS must be '0' or '1'")


def test_truncated_gguf(tmp_path):
    data = default_model_path().read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 3])
    assert_clean_error(weld("generate", "hello", "--model", str(bad)), "truncated.gguf")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_clean_error(weld("generate", "hello", "--model", str(tmp_path)), "GPT2LMHeadModel")


def test_empty_and_overlong_prompts(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    assert_clean_error(weld("generate", "", "--model", str(directory)), "empty")
    assert_clean_error(weld("generate", "The quick brown fox " * 40, "--model", str(directory),
                            "--max-model-len", "16"), "max_model_len")


# ----- speculative decoding flags: one definition (weld.config), the same on every command -----

SPEC_COMMANDS = {"generate": ["generate", "hello"], "chat": ["chat"], "serve": ["serve"], "bench": ["bench"]}


def parse(command: str, *flags: str):
    return cli.build_parser().parse_args([*SPEC_COMMANDS[command], *flags])


@pytest.mark.parametrize("command", list(SPEC_COMMANDS))
@pytest.mark.parametrize("flags,expected", [
    ([], None),
    (["--spec", "ngram"], {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3}),
    (["--spec", "ngram", "--spec-k", "2", "--spec-ngram-min", "2", "--spec-ngram-max", "5"],
     {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
    (["--spec", "draft", "--draft", "small.gguf"], {"method": "draft_model", "num_speculative_tokens": 4,
                                                    "model": "small.gguf"}),
    (["--spec", "dspark"], {"method": "dspark"}),  # the bundled model's own drafter, k its block size
    (["--spec", "dspark", "--draft", "drafter/", "--spec-k", "8"], {"method": "dspark", "num_speculative_tokens": 8,
                                                                    "model": "drafter/"}),
])
def test_flags_map_to_speculative_config(command, flags, expected):
    assert speculative_config_from_args(parse(command, *flags)) == expected


@pytest.mark.parametrize("flags,needle", [
    (["--draft", "small.gguf"], "--draft needs --spec"),
    (["--spec-k", "3"], "--spec-k needs --spec"),
    (["--spec-ngram-max", "4"], "--spec-ngram-max needs --spec"),
    (["--spec", "draft"], "--spec draft needs --draft PATH"),
    (["--spec", "ngram", "--draft", "small.gguf"], "--draft is for --spec draft or --spec dspark"),
    (["--spec", "draft", "--draft", "x", "--spec-ngram-min", "2"], "--spec-ngram-min is for --spec ngram"),
    (["--spec", "ngram", "--spec-ngram-min", "4"], "got 4 and 3"),
    (["--spec", "ngram", "--spec-k", "0"], "--spec-k must be >= 1"),
])
def test_bad_combinations(flags, needle):
    with pytest.raises(InvalidInputError, match=needle):
        speculative_config_from_args(parse("generate", *flags))


def test_unknown_method_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        parse("chat", "--spec", "eagle")
    assert "invalid choice: 'eagle'" in capsys.readouterr().err


class Recorded(WeldError):
    """Raised by the stand-in engines once they have the kwargs (nothing is loaded)."""


@pytest.mark.parametrize("command,module,attr", [
    ("generate", "weld.engine.llm", "LLM"),
    ("chat", "weld.engine.llm", "LLM"),
    ("serve", "weld.engine.async_llm", "AsyncLLM"),
])
def test_commands_pass_the_config_to_the_engine(command, module, attr, monkeypatch):
    seen = {}

    def engine(**kwargs):
        seen.update(kwargs)
        raise Recorded("recorded")

    monkeypatch.setattr(importlib.import_module(module), attr, engine)
    assert cli.main([*SPEC_COMMANDS[command], "--spec", "ngram", "--spec-k", "3", "--spec-ngram-max", "2"]) == 1
    spec = seen["engine_config"].speculative
    assert (spec.method, spec.k, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 1, 2)
    seen.clear()
    assert cli.main([*SPEC_COMMANDS[command], "--max-num-seqs", "5", "--block-size", "32",
                     "--no-enable-prefix-caching"]) == 1
    config = seen["engine_config"]
    assert config.speculative.method is None
    assert (config.scheduler.max_num_seqs, config.cache.page_size, config.cache.enable_prefix_caching) == (5, 32, False)


def test_one_line_errors_from_the_command_line():
    assert_clean_error(weld("serve", "--draft", "small.gguf"), "--draft needs --spec ngram, draft or dspark")
    assert_clean_error(weld("generate", "hello", "--spec", "draft"), "--spec draft needs --draft PATH")


def test_serve_refuses_a_taken_port_before_loading(tmp_path):
    """A port already in use is a one-line error at once, before any weight is read (the model
    path does not even exist: loading never started)."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        start = time.monotonic()
        proc = weld("serve", "--model", str(tmp_path / "never-read"), "--port", str(port), timeout=60)
    assert_clean_error(proc, f"cannot listen on 127.0.0.1:{port}")
    assert time.monotonic() - start < 30


def test_serve_warmup_flag():
    from weld.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).warmup == "basic"
    assert parser.parse_args(["serve", "--warmup", "full"]).warmup == "full"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--warmup", "all"])


def test_async_warmup_full_leaves_nothing_to_compile(tiny_llama_dir, keep_programs):
    """`weld serve --warmup full`: AsyncLLM.warmup(full=True) compiles every shape first, so
    requests at default sampling compile nothing more."""
    import asyncio

    from weld.engine.async_llm import AsyncLLM
    from weld.engine.sampling_params import SamplingParams

    engine = AsyncLLM(str(tiny_llama_dir[0]), max_model_len=64, kv_cache_memory_gb=0.01, max_num_seqs=2,
                      max_num_batched_tokens=32, steps_per_call=4)
    keep_programs(engine.llm.engine.runner)
    try:
        engine.warmup(full=True)
        compiled = engine.llm.engine.runner.num_compiles

        async def one(i):
            async for _ in engine.generate("hello there " * (i + 1), SamplingParams(max_tokens=5, temperature=0),
                                           request_id=f"r{i}"):
                pass

        async def main():
            await asyncio.gather(*(one(i) for i in range(3)))

        asyncio.run(main())
        assert engine.llm.engine.runner.num_compiles == compiled
    finally:
        engine.shutdown()


def test_serve_warmup_has_the_runner_drop_tracing_caches(tiny_llama_dir):
    """`weld serve`'s warm-up (even "none") makes the runner drop JAX's tracing caches after
    each run of compiles (a served process's memory); a plain engine keeps them."""
    from weld.engine.async_llm import AsyncLLM
    from weld.server.app import warmup

    engine = AsyncLLM(str(tiny_llama_dir[0]), max_model_len=64, kv_cache_memory_gb=0.01, max_num_seqs=2)
    try:
        assert not engine.engine.runner.drop_traces
        warmup(engine, "none")
        assert engine.engine.runner.drop_traces and engine.engine.runner.num_compiles == 0
    finally:
        engine.shutdown()
