"""`weld bench`: a real (tiny) run writes the JSON, the floor bytes match a hand count, bad flags
give one line. No speed is asserted anywhere: only that the numbers exist and are consistent."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from weld import bench


def weld(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WELD_PROGRESS": "0", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "weld.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_clean_error(proc: subprocess.CompletedProcess, needle: str):
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weld: error: "), proc.stderr
    assert needle in lines[0], lines[0]


def test_tiny_run_writes_json_and_prints_a_table(tiny_llama_dir, tmp_path):
    directory, _ = tiny_llama_dir
    out = tmp_path / "nested" / "bench.json"
    proc = weld("bench", "--model", str(directory), "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4",
                "--prefill-len", "16", "--runs", "1", "--bandwidth-gb", "0.05", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "decode tok/s, batch 2" in proc.stdout and str(out) in proc.stdout
    result = json.loads(out.read_text())
    for key in ("started", "command", "machine", "versions", "config", "bandwidth_start", "bandwidth_end",
                "engines", "ratios"):
        assert key in result, key
    assert result["config"]["batch_sizes"] == [1, 2] and result["config"]["prefill_len"] == 16
    assert result["versions"]["jax"] and result["machine"]["cpu_count"] >= 1
    assert result["bandwidth_start"]["used_gb_s"] > 0
    assert list(result["engines"]) == ["weld"] and result["ratios"] == {}
    w = result["engines"]["weld"]
    assert w["ttft_s"] > 0 and w["prefill"]["tok_s"] > 0 and w["load_s"] > 0
    for b in (1, 2):
        d = w["decode"][str(b)]
        assert len(d["t_full_s"]) == len(d["t_one_s"]) == 1
        t_full, t_one = d["t_full_s"][0], d["t_one_s"][0]
        assert t_full > 0 and t_one > 0 and d["floor_tok_s"] > 0
        # The rate is the stated formula of the raw times (None only if noise made t_full <= t_one).
        expected = b * 3 / (t_full - t_one) if t_full > t_one else None
        assert d["tok_s"] == pytest.approx(expected)


def test_floor_bytes_hand_count_for_the_tiny_llama(tiny_llama_dir):
    """Tiny llama (conftest): hidden 64, intermediate 96, 2 layers, 4 heads, 2 KV heads, head_dim 16,
    untied embeddings, f32. A step reads every weight once except the input embedding, of which
    it gathers one row per sequence; the K/V of 2 layers x 2 heads x 16 per token in context."""
    directory, hf_model = tiny_llama_dir
    vocab = hf_model.config.vocab_size
    engine = bench.WeldEngine(str(directory), "float32", max_batch=2, max_model_len=32)
    per_layer = 2 * 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 3 * (96 * 64)  # norms, q, k+v, o, gate+up+down
    total = 4 * (2 * per_layer + 64 + 2 * vocab * 64)  # + final norm, embed and lm_head
    assert engine.weight_bytes == bench.WeightBytes(total=total, untied_embedding=4 * vocab * 64,
                                                    embedding_row=4 * 64)
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    step = bench.floor_bytes(engine.weight_bytes, engine.kv_bytes_per_token, batch=2, input_len=8, output_len=4)
    # decode steps j = 1..3 see 8 + j tokens: mean context 10 tokens per sequence
    assert step["weights"] == 4 * (2 * per_layer + 64 + vocab * 64 + 2 * 64)
    assert step["kv_mean"] == 2 * 512 * 10
    assert step["total"] == step["weights"] + step["kv_mean"]


def test_tied_embedding_is_read_whole_as_the_lm_head():
    tied = bench.WeightBytes(total=1000, untied_embedding=0, embedding_row=8)
    assert bench.floor_bytes(tied, 10, batch=4, input_len=6, output_len=4)["weights"] == 1000
    assert bench.floor_bytes(tied, 10, batch=4, input_len=6, output_len=4)["kv_mean"] == 4 * 10 * 8


def test_prompts_are_seeded_and_in_vocabulary():
    a = bench.make_prompts(100, 3, 5, seed=7)
    assert a == bench.make_prompts(100, 3, 5, seed=7) != bench.make_prompts(100, 3, 5, seed=8)
    assert len(a) == 3 and all(len(p) == 5 and all(0 <= t < 100 for t in p) for p in a)


@pytest.mark.parametrize("text,needle", [("1,x", "'x' is not an integer"), ("0", ">= 1"), ("4,4", "twice"),
                                         ("", "is not an integer")])
def test_parse_batch_sizes_rejects(text, needle):
    with pytest.raises(bench.InvalidInputError, match=needle):
        bench.parse_batch_sizes(text)
    assert bench.parse_batch_sizes("16, 1,4") == (16, 1, 4)


@pytest.mark.parametrize("args,needle", [
    (["--batch-sizes", "1,two"], "--batch-sizes"),
    (["--output-len", "1"], "--output-len must be >= 2"),
    (["--runs", "0"], "--runs"),
    (["--vs", "vllm"], "unknown engine 'vllm'"),
    (["--model", "/nonexistent/model.gguf"], "no such file"),
])
def test_bad_flags_give_one_line(args, needle):
    assert_clean_error(weld("bench", "--bandwidth-gb", "0.01", *args), needle)


def test_missing_llama_cpp_says_how_to_install(monkeypatch):
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else real(name))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(bench.WeldError, match="pip install llama-cpp-python"):
        bench.config_from_args(parser.parse_args(["--vs", "llamacpp"]))


def test_llama_cpp_batch_rows_match_single_runs():
    """The llama_batch bookkeeping (positions, sequence ids, which logits) is right: a row decoded
    among others gives the same greedy tokens as decoded alone."""
    pytest.importorskip("llama_cpp")
    from weld.models import llama
    from weld.weights import default_model_path
    from weld.weights.gguf import read_metadata

    path = default_model_path()
    cfg = llama.Config.from_gguf(read_metadata(path))
    engine = bench.LlamaCppEngine(path, max_batch=2, max_model_len=32, threads=1, cfg=cfg)
    try:
        p, q = bench.make_prompts(cfg.vocab_size, 2, 9, seed=0)
        together = engine.generate([p, q[:5]], 6)
        assert [len(r) for r in together] == [6, 6]
        assert together[0] == engine.generate([p], 6)[0]
        assert together[1] == engine.generate([q[:5]], 6)[0]
    finally:
        engine.close()
