"""The `weld` command line, run as a subprocess: help, a real generate and chat, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


def test_chat_keeps_history(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    proc = weld("chat", "--model", str(directory), "--max-tokens", "4", "--temperature", "0",
                "--max-model-len", "128", stdin="Paris\nThe quick brown fox\n")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) >= 2  # one reply per user line


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
])
def test_bad_arguments(args, needle):
    assert_clean_error(weld("generate", "hello", *args), needle)


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
