"""`weld bench`: a real (tiny) run writes the JSON, the floor bytes match a hand count, bad flags
give one line. No speed is asserted anywhere: only that the numbers exist and are consistent."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import pytest

from weld import bench
from weld.bench import engines, roofline, runner, summary
from weld.bench import flags as bench_flags
from weld.utils.errors import InvalidInputError, WeldError

from test_bench_chart import RESULTS, check_chart


def weld(*args: str, timeout: int = 300, progress: bool = False) -> subprocess.CompletedProcess:
    """`weld ARGS` in a subprocess, stderr captured (not a terminal): progress lines only if asked."""
    env = {**os.environ, "WELD_PROGRESS": "1" if progress else "0", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "weld.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_clean_error(proc: subprocess.CompletedProcess, needle: str):
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weld: error: "), proc.stderr
    assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_run(tiny_llama_dir, tmp_path_factory):
    """One real `weld bench` of the tiny llama at batch 1 and 2, two repetitions, with progress
    asked for (WELD_PROGRESS=1) on a stderr that is not a terminal. Returns (process, JSON path)."""
    directory, _ = tiny_llama_dir
    out = tmp_path_factory.mktemp("bench") / "nested" / "bench.json"
    proc = weld("bench", "--model", str(directory), "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4",
                "--prefill-len", "16", "--runs", "2", "--bandwidth-gb", "0.05", "--out", str(out), progress=True)
    return proc, out


def test_tiny_run_writes_json_and_prints_a_table(tiny_run):
    proc, out = tiny_run
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
        assert len(d["t_full_s"]) == len(d["t_one_s"]) == 2
        for t_full, t_one, rate in zip(d["t_full_s"], d["t_one_s"], d["tok_s_per_run"]):
            assert t_full > 0 and t_one > 0 and d["floor_tok_s"] > 0
            # The rate is the stated formula of the raw times (None only if noise made t_full <= t_one).
            assert rate == pytest.approx(b * 3 / (t_full - t_one) if t_full > t_one else None)
        valid = [r for r in d["tok_s_per_run"] if r is not None]
        assert d["tok_s"] == pytest.approx(statistics.median(valid) if valid else None)


def test_tiny_run_shows_each_finished_step_on_stderr(tiny_run):
    """Not a terminal, WELD_PROGRESS=1: one line per warm-up and timed step (no bar: no carriage
    returns), each naming the engine, the batch or prefill, the run i of n and a running count;
    the timed decode lines carry that run's tok/s, which is the JSON's."""
    proc, out = tiny_run
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    label = json.loads(out.read_text())["engines"]["weld"]["label"]
    per_run = {b: d["tok_s_per_run"] for b, d in json.loads(out.read_text())["engines"]["weld"]["decode"].items()}
    steps = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    # weld: warm-up at batch 1, 2 and the prefill; then 2 repetitions of batch 1, 2 and the prefill
    assert len(steps) == 3 + 2 * 3, proc.stderr
    assert all(f"/{len(steps)}]" in line and f"| {label} |" in line for line in steps), steps
    assert [line.split("] ", 1)[1].split(":")[0] for line in steps] == [
        f"warm-up + compile | {label} | batch 1", f"warm-up + compile | {label} | batch 2",
        f"warm-up + compile | {label} | prefill 16 tokens",
        *(f"timed run {i}/2 | {label} | {what}" for i in (1, 2) for what in ("batch 1", "batch 2", "prefill 16 tokens"))]
    elapsed = [float(line[1:].split("s", 1)[0]) for line in steps]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0
    for b in ("1", "2"):
        lines = [line for line in steps if "timed run" in line and f"batch {b}:" in line]
        assert len(lines) == len(per_run[b]) == 2
        for line, rate in zip(lines, per_run[b]):
            assert (f"decode {rate:.1f} tok/s" if rate is not None else "decode tok/s n/a") in line, line
    if None not in per_run["2"]:
        assert "(median " in steps[-2]  # batch 2's second run: the median of the two so far
    assert all("prefill " in line and "tok/s" in line for line in steps if "timed" in line and "prefill" in line)
    assert [line for line in proc.stderr.splitlines() if line.startswith("Loading weld ...")], proc.stderr


def test_tiny_run_writes_its_chart_next_to_the_json(tiny_run):
    proc, out = tiny_run
    assert proc.returncode == 0, proc.stderr
    svg = out.with_suffix(".svg")
    assert str(svg) in proc.stdout
    check_chart(svg, json.loads(out.read_text()))


def test_floor_bytes_hand_count_for_the_tiny_llama(tiny_llama_dir):
    """Tiny llama (conftest): hidden 64, intermediate 96, 2 layers, 4 heads, 2 KV heads, head_dim 16,
    untied embeddings, f32. A step reads every weight once except the input embedding, of which
    it gathers one row per sequence; the K/V of 2 layers x 2 heads x 16 per token in context.
    A packed LM head (the native CPU kernel's panels) is read with its zero padding to 16 rows."""
    from weld.models.common.layers import PackedWeight

    directory, hf_model = tiny_llama_dir
    vocab = hf_model.config.vocab_size
    engine = engines.WeldEngine(str(directory), "float32", max_batch=2, max_model_len=32)
    head_rows = -(-vocab // 16) * 16 if isinstance(engine.llm.model.weights["lm_head"], PackedWeight) else vocab
    per_layer = 2 * 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 3 * (96 * 64)  # norms, q, k+v, o, gate+up+down
    total = 4 * (2 * per_layer + 64 + vocab * 64 + head_rows * 64)  # + final norm, embed and lm_head
    assert engine.weight_bytes == roofline.WeightBytes(total=total, untied_embedding=4 * vocab * 64,
                                                       embedding_row=4 * 64)
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    step = roofline.floor_bytes(engine.weight_bytes, engine.kv_bytes_per_token, batch=2, input_len=8, output_len=4)
    # decode steps j = 1..3 see 8 + j tokens: mean context 10 tokens per sequence
    assert step["weights"] == 4 * (2 * per_layer + 64 + head_rows * 64 + 2 * 64)
    assert step["kv_mean"] == 2 * 512 * 10
    assert step["total"] == step["weights"] + step["kv_mean"]


def test_tied_embedding_is_read_whole_as_the_lm_head():
    tied = roofline.WeightBytes(total=1000, untied_embedding=0, embedding_row=8)
    assert roofline.floor_bytes(tied, 10, batch=4, input_len=6, output_len=4)["weights"] == 1000
    assert roofline.floor_bytes(tied, 10, batch=4, input_len=6, output_len=4)["kv_mean"] == 4 * 10 * 8


def test_the_floor_of_a_mixture_of_experts_counts_the_experts_a_batch_chose():
    """Batch 1 reads top_k of num_experts; a large batch reads nearly all of them (uniform routing)."""
    moe = roofline.WeightBytes(total=1000, untied_embedding=0, embedding_row=0, experts=800, top_k=2, num_experts=8)
    one = roofline.floor_bytes(moe, 0, batch=1, input_len=1, output_len=2)
    assert one["weights"] == 200 + 800 * 2 / 8 and one["all_weights"] == 1000
    sixteen = roofline.floor_bytes(moe, 0, batch=16, input_len=1, output_len=2)
    assert sixteen["weights"] == pytest.approx(200 + 800 * (1 - 0.75 ** 16))
    dense = roofline.WeightBytes(total=1000, untied_embedding=0, embedding_row=0)
    assert roofline.floor_bytes(dense, 0, batch=1, input_len=1, output_len=2)["weights"] == 1000


def test_prompts_are_seeded_and_in_vocabulary():
    a = runner.make_prompts(100, 3, 5, seed=7)
    assert a == runner.make_prompts(100, 3, 5, seed=7) != runner.make_prompts(100, 3, 5, seed=8)
    assert len(a) == 3 and all(len(p) == 5 and all(0 <= t < 100 for t in p) for p in a)


@pytest.mark.parametrize("text,needle", [("1,x", "'x' is not an integer"), ("0", ">= 1"), ("4,4", "twice"),
                                         ("", "is not an integer")])
def test_parse_batch_sizes_rejects(text, needle):
    with pytest.raises(InvalidInputError, match=needle):
        bench_flags.parse_batch_sizes(text)
    assert bench_flags.parse_batch_sizes("16, 1,4") == (16, 1, 4)


@pytest.mark.parametrize("args,needle", [
    (["--batch-sizes", "1,two"], "--batch-sizes"),
    (["--output-len", "1"], "--output-len must be >= 2"),
    (["--runs", "0"], "--runs"),
    (["--vs", "vllm"], "unknown engine 'vllm'"),
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["--chart", "/nonexistent/result.json"], "--chart /nonexistent/result.json: no such file"),
    (["--chart", str(RESULTS / "perplexity_2026-12-01_smollm2.json")], "is not a `weld bench` result"),
])
def test_bad_flags_give_one_line(args, needle):
    assert_clean_error(weld("bench", "--bandwidth-gb", "0.01", *args), needle)


def test_missing_llama_cpp_says_how_to_install(monkeypatch):
    real = bench_flags.importlib.util.find_spec
    monkeypatch.setattr(bench_flags.importlib.util, "find_spec",
                        lambda name: None if name == "llama_cpp" else real(name))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(WeldError, match="pip install llama-cpp-python"):
        bench_flags.config_from_args(parser.parse_args(["--vs", "llamacpp"]))


@pytest.mark.llamacpp
def test_llama_cpp_batch_rows_match_single_runs():
    """The llama_batch bookkeeping (positions, sequence ids, which logits) is right: a row decoded
    among others gives the same greedy tokens as decoded alone. Needs the bench extra
    (llama-cpp-python, built from source): `pytest -m llamacpp` where it is installed."""
    import llama_cpp  # noqa: F401  (a missing bench extra is a failure here, not a skip)
    from weld.weights import default_model_path, load_model

    path = default_model_path()
    model = load_model(path)
    engine = engines.LlamaCppEngine(path, max_batch=2, max_model_len=32, threads=1,
                                    cache_spec=model.family.cache_spec(model.cfg))
    try:
        p, q = runner.make_prompts(model.cfg.vocab_size, 2, 9, seed=0)
        together = engine.generate([p, q[:5]], 6)
        assert [len(r) for r in together] == [6, 6]
        assert together[0] == engine.generate([p], 6)[0]
        assert together[1] == engine.generate([q[:5]], 6)[0]
    finally:
        engine.close()


# ----- weld bench --spec: plain and speculative weld on the same text prompts -----

# Copy-heavy prompts in the tiny tokenizer's corpus: n-gram lookup finds their phrases again.
COPY_PROMPTS = [
    "Repeat: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Copy: def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b".replace("\n", " "),
    "Once upon a time there was a small model that wrote tests. Once upon a time there was a small model",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}


def test_speculative_run_reports_both_engines_and_the_engine_acceptance(tiny_llama_dir, tmp_path):
    """Both engines run the file's prompts (batch 1; grouping at larger batches is unit-tested
    below); the speculative figures are exactly the counters of an engine that generates the same
    prompts one at a time, and the token counts are the tokens those generations produced
    (stopping at EOS)."""
    from weld import LLM, SamplingParams

    directory, _ = tiny_llama_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(COPY_PROMPTS) + "\n\n")  # the blank line is skipped
    out = tmp_path / "bench.json"
    # --prefill-len 24 falls in the prompts' token bucket (32): no extra program to compile
    proc = weld("bench", "--model", str(directory), "--spec", "ngram", "--spec-k", "3", "--no-spec-adaptive", "--prompts", str(prompts),
                "--batch-sizes", "1", "--output-len", "16", "--prefill-len", "24", "--runs", "1",
                "--bandwidth-gb", "0.05", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "speculative decoding: ngram" in proc.stdout and "mean accepted len" in proc.stdout
    assert "timed run" not in proc.stderr and "warm-up" not in proc.stderr  # WELD_PROGRESS=0: no progress
    result = json.loads(out.read_text())
    assert list(result["engines"]) == ["weld", engines.SPEC_ENGINE] and result["ratios"] == {}
    check_chart(out.with_suffix(".svg"), result)  # plain and speculative: a series each
    assert result["workload"]["num_prompts"] == 3 and result["workload"]["stop_at_eos"]
    spec = result["speculative"]
    assert spec["config"] == SPEC

    # The reference engine has the bench engines' shapes, so it reuses their compiled programs.
    info = result["engines"][engines.SPEC_ENGINE]
    llm = LLM(model=str(directory), max_model_len=info["max_model_len"], max_num_seqs=1, page_size=info["page_size"],
              num_pages=info["num_pages"], enable_prefix_caching=False, speculative_config=SPEC)
    params = SamplingParams(max_tokens=16, temperature=0)
    produced = sum(len(llm.generate(p, params)[0].outputs[0].token_ids) for p in COPY_PROMPTS)
    stats = llm.engine.spec_stats()
    assert stats["spec_num_accepted_tokens"] > 0, "copy prompts should get drafts accepted"

    row = spec["per_batch"]["1"]
    assert row["outputs_equal"], "greedy speculation must give the plain tokens"
    for name in ("weld", engines.SPEC_ENGINE):
        d = result["engines"][name]["decode"]["1"]
        assert d["tokens_full"] == [produced] and d["tokens_one"] == [3] and d["groups"] == 3
        t_full, t_one = d["t_full_s"][0], d["t_one_s"][0]
        assert d["tok_s"] == pytest.approx((produced - 3) / (t_full - t_one) if t_full > t_one else None)
    assert row["plain_tok_s"] == result["engines"]["weld"]["decode"]["1"]["tok_s"]
    assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"])
    acc = row["acceptance"]
    assert (acc["num_drafts"], acc["num_draft_tokens"], acc["num_accepted_tokens"]) == (
        stats["spec_num_drafts"], stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"])
    assert acc["accepted_per_position"] == stats["spec_accepted_per_position"]
    assert acc["drafted_per_position"] == stats["spec_drafted_per_position"]
    assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["num_accepted_tokens"] / acc["num_drafts"])
    assert acc["per_position_rate"] == pytest.approx(
        [a / d for a, d in zip(stats["spec_accepted_per_position"], stats["spec_drafted_per_position"])])


def bench_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("flags,needle", [
    (["--chat"], "--chat is for --prompts"),
    (["--ignore-eos"], "--ignore-eos is for --prompts"),
    (["--prompts", "{file}", "--vs", "hf"], "--prompts runs weld only"),
    (["--prompts", "{file}", "--batch-sizes", "1,4"], "batch 4 exceeds the 3 prompts"),
    (["--prompts", "{empty}"], "holds no prompt"),
    (["--prompts", "/nonexistent/prompts.txt"], "no such file"),
    (["--spec", "draft"], "--spec draft needs --draft"),
    (["--spec", "ngram", "--spec-k", "99"], "num_speculative_tokens"),  # the engine's own check, before loading
])
def test_bad_text_and_speculative_flags(flags, needle, tmp_path):
    (tmp_path / "p.txt").write_text("\n".join(COPY_PROMPTS))
    (tmp_path / "empty.txt").write_text("\n \n")
    flags = [f.format(file=tmp_path / "p.txt", empty=tmp_path / "empty.txt") for f in flags]
    with pytest.raises(InvalidInputError, match=needle):
        bench_flags.config_from_args(bench_args("--bandwidth-gb", "0.01", *flags))


def test_default_batch_sizes_are_small_for_speculation_and_text(tmp_path):
    (tmp_path / "p.txt").write_text("\n".join(COPY_PROMPTS * 2))
    assert bench_flags.config_from_args(bench_args()).batch_sizes == (1, 4, 16, 64)
    assert bench_flags.config_from_args(bench_args("--spec", "ngram")).batch_sizes == (1, 4)
    cfg = bench_flags.config_from_args(bench_args("--prompts", str(tmp_path / "p.txt"), "--chat"))
    assert cfg.batch_sizes == (1, 4) and cfg.spec is None and cfg.chat and not cfg.ignore_eos


def test_text_prompts_run_in_groups_of_the_batch_size():
    prompts = [[i] for i in range(5)]
    assert runner.workload(prompts, 2, text=True) == [[[0], [1]], [[2], [3]], [[4]]]
    assert runner.workload(prompts, 1, text=True) == [[[i]] for i in range(5)]
    assert runner.workload(prompts, 3, text=False) == [[[0], [1], [2]]]  # random prompts: one batch


def test_acceptance_figures_by_hand():
    before = {"spec_num_drafts": 1, "spec_num_draft_tokens": 3, "spec_num_accepted_tokens": 1,
              "spec_drafted_per_position": [1, 1, 1], "spec_accepted_per_position": [1, 0, 0]}
    after = {"spec_num_drafts": 5, "spec_num_draft_tokens": 13, "spec_num_accepted_tokens": 6,
             "spec_drafted_per_position": [5, 4, 4], "spec_accepted_per_position": [4, 1, 1]}
    delta = summary.spec_delta(before, after)
    assert delta == {"spec_num_drafts": 4, "spec_num_draft_tokens": 10, "spec_num_accepted_tokens": 5,
                     "spec_drafted_per_position": [4, 3, 3], "spec_accepted_per_position": [3, 1, 1]}
    twice = summary.spec_add(summary.spec_add(None, delta), delta)
    assert twice["spec_num_drafts"] == 8 and twice["spec_accepted_per_position"] == [6, 2, 2]
    acc = summary.acceptance(twice)
    # 8 verification steps emitted 8 + 10 tokens: 2.25 per step; 10 of 20 drafts accepted
    assert acc["mean_acceptance_length"] == pytest.approx(2.25) and acc["acceptance_rate"] == pytest.approx(0.5)
    assert acc["per_position_rate"] == pytest.approx([0.75, 1 / 3, 1 / 3])


class _CompilingOnce(engines.WeldEngine):
    """A weld engine stand-in whose first full-length run compiles a program (as a shape the
    warm-up missed would), and whose every run takes the same few calls."""

    def __init__(self, compiles_on_call: int):
        self.name, self.label, self.calls, self.compiles, self.on = "weld", "fake weld", 0, 0, compiles_on_call

    def generate(self, group, max_tokens):
        self.calls += 1
        self.compiles += self.calls == self.on
        return [[7] * max_tokens for _ in group]

    def num_compiles(self):
        return self.compiles

    def spec_counters(self):
        return None


class _Progress:
    def begin(self, what):
        pass

    def finish(self, what, seconds, **figures):
        pass


@pytest.mark.parametrize("compiles_on_call,repeated", [(2, 1), (None, 0)])
def test_a_timed_repetition_that_compiled_runs_again(compiles_on_call, repeated):
    """Seconds of compile in a timed run would sink its median: the repetition runs again."""
    engine = _CompilingOnce(compiles_on_call)
    cfg = argparse.Namespace(runs=2, batch_sizes=(1,), output_len=3)
    loaded = argparse.Namespace(engines=[engine], prefill_prompt=[[1, 2]], prefill_len=2)
    raw, _, _, retried = runner.timed_runs(loaded, {1: [[[1, 2]]]}, {"weld": 2}, cfg, _Progress())
    assert retried == {"weld": repeated}
    assert len(raw["weld"]["decode"][1]["t_full"]) == 2  # two repetitions recorded either way
    assert engine.calls == 2 * 2 + 2 * repeated + 2  # (1-token + full) per repetition and retry, prefill twice
