"""The run of `weld bench`: load the engines (`load_engines`), warm them up (`warm_up`), time the
interleaved repetitions (`timed_runs`), and assemble the result dict (`run`).

Interleaved: for each workload every engine runs it before the next workload starts, and the
order of the engines flips every repetition, so that a change in background load hits them all
alike and no engine always runs first.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from weld.bench.engines import SPEC_ENGINE, HFEngine, LlamaCppEngine, WeldEngine
from weld.bench.flags import DEFAULT_PREFILL_LEN, BenchConfig, read_prompts
from weld.bench.roofline import machine_info, measure_bandwidth, versions
from weld.bench.progress import BenchProgress
from weld.bench.summary import decode_rate, ratios, spec_add, spec_delta, speculative_summary, summarize_engine
from weld.engine.spec.policy import bucket
from weld.utils.errors import InvalidInputError
from weld.utils.progress import progress_enabled, status


def make_prompts(vocab_size: int, rows: int, length: int, seed: int) -> list[list[int]]:
    """Fixed random token ids: the same for every engine and every run with this seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(rows, length)).tolist()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _check_lengths(engine, outs: list[list[int]], rows: int, max_tokens: int) -> None:
    exact = getattr(engine, "ignore_eos", True)
    if len(outs) != rows or any(len(o) != max_tokens if exact else not 1 <= len(o) <= max_tokens for o in outs):
        raise RuntimeError(f"{engine.name} returned {[len(o) for o in outs]} tokens for {rows} rows of "
                           f"{'' if exact else 'at most '}{max_tokens}")


def encode_prompts(source, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of text prompts with the model's own tokenizer (loaded alone, before the engines,
    so that they can be sized for the longest prompt): raw, with BOS as the model asks, or each as
    one user message through the chat template, as `LLM.chat` renders it."""
    from weld.tokenizer import Tokenizer

    if source.kind == "gguf":
        from weld.weights.gguf import read_metadata

        tok = Tokenizer.from_gguf_metadata(read_metadata(source.path))
    else:
        tok = Tokenizer.from_hf_dir(source.path)
    if not chat:
        return [tok.encode(text) for text in texts]
    rendered = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
                for text in texts]
    return [tok.encode(text, add_special_tokens=False) for text in rendered]


def workload(prompts: list[list[int]], batch: int, text: bool) -> list[list[list[int]]]:
    """The groups of prompts run at batch `batch`: random prompts are one group of `batch` rows;
    text prompts all run, `batch` at a time (the last group may be smaller)."""
    if not text:
        return [prompts[:batch]]
    return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


@dataclasses.dataclass
class Loaded:
    """The engines of a run, loaded and sized, and the prompts they run."""

    engines: list[Any]  # weld first, then weld-spec, hf and llamacpp as asked
    load_s: dict[str, float]  # engine name -> seconds
    prompts: list[list[int]]  # the encoded text prompts, or max(batch sizes) rows of random token ids
    prefill_prompt: list[list[int]]  # one row of prefill_len random token ids
    prefill_len: int
    model_len: int  # the longest sequence a run needs: a prompt + its new tokens, or the prefill prompt + 1


def load_engines(cfg: BenchConfig, source, text_prompts: list[list[int]] | None, show: bool) -> Loaded:
    """Loads weld first (its context bounds the lengths, checked right after), then the others."""
    if text_prompts:
        decode_len = max(len(p) for p in text_prompts) + cfg.output_len
    else:
        decode_len = cfg.input_len + cfg.output_len
    max_batch = max(cfg.batch_sizes)
    wanted_len = max(decode_len, (cfg.prefill_len or DEFAULT_PREFILL_LEN) + 1)
    ignore_eos = cfg.ignore_eos or not text_prompts
    engines: list[Any] = []
    load_s: dict[str, float] = {}

    def load(what: str, make: Callable[[], Any]) -> Any:
        with status(f"Loading {what}", enabled=show):
            t, engine = timed(make)
        engines.append(engine)
        load_s[engine.name] = t
        return engine

    def weld_engine(spec: dict[str, Any] | None) -> WeldEngine:
        return WeldEngine(str(source.path), cfg.dtype, max_batch, wanted_len, decode_len, speculative_config=spec,
                          ignore_eos=ignore_eos, **cfg.weld_options)

    weld = load("weld", lambda: weld_engine(None))
    if decode_len > weld.max_model_len:
        what = (f"the longest prompt of {cfg.prompts} ({decode_len - cfg.output_len} tokens)" if text_prompts
                else f"--input-len {cfg.input_len}")
        raise InvalidInputError(f"{what} + --output-len {cfg.output_len} exceeds the model's context of "
                                f"{weld.max_model_len} tokens")
    if cfg.prefill_len is not None and cfg.prefill_len + 1 > weld.max_model_len:
        raise InvalidInputError(f"--prefill-len {cfg.prefill_len} + 1 exceeds the model's context of "
                                f"{weld.max_model_len} tokens")
    prefill_len = cfg.prefill_len or min(DEFAULT_PREFILL_LEN, weld.max_model_len - 1)
    model_len = max(decode_len, prefill_len + 1)
    if cfg.spec is not None:
        load(f"weld with {cfg.spec['method']} speculation", lambda: weld_engine(cfg.spec))
    if "hf" in cfg.vs:
        load("HF transformers (dequantizing to f32)", lambda: HFEngine(source, cfg.threads, weld.cache_spec, weld.cfg.moe))
    if "llamacpp" in cfg.vs:
        load("llama.cpp", lambda: LlamaCppEngine(source.path, max_batch, model_len, cfg.threads, weld.cache_spec,
                                                           weld.cfg.moe))
    prompts = text_prompts if text_prompts else make_prompts(weld.cfg.vocab_size, max_batch, cfg.input_len, cfg.seed)
    prefill_prompt = make_prompts(weld.cfg.vocab_size, 1, prefill_len, cfg.seed + 1)
    return Loaded(engines, load_s, prompts, prefill_prompt, prefill_len, model_len)


def warm_up_steps(engines: list[Any], cfg: BenchConfig) -> int:
    """How many progress steps `warm_up` takes: weld one per batch size, the others one; each a
    prefill more."""
    return sum((len(cfg.batch_sizes) if isinstance(e, WeldEngine) else 1) + 1 for e in engines)


def timed_steps(runs: dict[str, int], cfg: BenchConfig) -> int:
    """How many progress steps `timed_runs` takes: per repetition, each batch size and the prefill."""
    return sum(n * (len(cfg.batch_sizes) + 1) for n in runs.values())


def _batch_text(batch: int, groups: list) -> str:
    return f"batch {batch}" + (f" ({len(groups)} groups)" if len(groups) > 1 else "")


def warm_up(loaded: Loaded, groups: dict[int, list[list[list[int]]]], cfg: BenchConfig,
            progress: BenchProgress) -> dict:
    """Untimed runs; returns their seconds per engine. weld compiles a program per bucket, so it
    runs every batch size (every group of text prompts: their lengths fall in different buckets),
    and an adaptive speculative weld until it has run every speculation width at each (its first
    call of a width compiles it); the others warm their allocators and caches at batch 1."""
    warmup_s: dict[str, float] = {}
    for e in loaded.engines:
        start = time.perf_counter()
        is_weld = isinstance(e, WeldEngine)
        phase = f"warm-up + compile | {e.label}" if is_weld else f"warm-up | {e.label}"
        for batch in cfg.batch_sizes if is_weld else (1,):
            warm = groups[batch] if is_weld else [loaded.prompts[:1]]
            what = f"{phase} | {_batch_text(batch, warm)}"
            progress.begin(what)
            step_start = time.perf_counter()
            for group in warm:
                e.generate(group, min(cfg.output_len, 24))
                e.generate(group, 1)
                if is_weld:  # an adaptive speculative engine: compile every width too
                    policy = e.llm.engine.width_policy
                    for _ in range(2 * len(policy.widths)):
                        if all((bucket(len(group)), w) in policy.rates for w in policy.widths) or len(policy.widths) == 1:
                            break
                        e.generate(group, min(cfg.output_len, 24))
            progress.finish(what, time.perf_counter() - step_start)
        what = f"{phase} | prefill {loaded.prefill_len} tokens"
        progress.begin(what)
        progress.finish(what, timed(lambda: e.generate(loaded.prefill_prompt, 1))[0])
        warmup_s[e.name] = time.perf_counter() - start
    return warmup_s


def time_workload(engine, groups: list[list[list[int]]], output_len: int) -> tuple[dict, list, dict | None]:
    """One repetition of one engine at one batch size: each group's 1-token run, then its full run.
    Returns the summed times and token counts, the full runs' outputs, and what the speculative
    engine's counters gained over the full runs (None for the other engines)."""
    sums = {"t_one": 0.0, "t_full": 0.0, "tokens_one": 0, "tokens_full": 0}
    produced: list[list[int]] = []
    counts = None
    for group in groups:
        t, outs = timed(lambda: engine.generate(group, 1))
        _check_lengths(engine, outs, len(group), 1)
        sums["t_one"] += t
        sums["tokens_one"] += sum(map(len, outs))
        before = engine.spec_counters() if engine.name == SPEC_ENGINE else None
        t, outs = timed(lambda: engine.generate(group, output_len))
        _check_lengths(engine, outs, len(group), output_len)
        if before is not None:
            counts = spec_add(counts, spec_delta(before, engine.spec_counters()))
        sums["t_full"] += t
        sums["tokens_full"] += sum(map(len, outs))
        produced += outs
    return sums, produced, counts


RETRIES_AFTER_COMPILE = 3  # a weld repetition that compiled a program runs again, at most this often


def timed_runs(loaded: Loaded, groups: dict, runs: dict[str, int], cfg: BenchConfig,
               progress: BenchProgress) -> tuple:
    """The timed repetitions, interleaved. A weld repetition during which the engine compiled a
    program (a shape or speculation width the warm-up did not reach: seconds on a CPU) runs
    again, up to RETRIES_AFTER_COMPILE times. Returns the raw times per engine, the speculative
    counters per batch size (summed over the timed full runs), each engine's outputs of its
    first repetition per batch size, and how many repetitions each engine ran again."""
    engines = loaded.engines
    raw = {e.name: {"decode": {b: {"t_full": [], "t_one": [], "tokens_full": [], "tokens_one": [],
                                   "groups": len(groups[b])} for b in cfg.batch_sizes}, "prefill_s": []}
           for e in engines}
    spec_counts: dict[int, dict[str, Any] | None] = {b: None for b in cfg.batch_sizes}
    outputs: dict[str, dict[int, list[list[int]]]] = {e.name: {} for e in engines}
    retried = {e.name: 0 for e in engines}
    for rep in range(cfg.runs):
        order = engines if rep % 2 == 0 else engines[::-1]
        for batch in cfg.batch_sizes:
            for e in order:
                if rep >= runs[e.name]:
                    continue
                what = f"timed run {rep + 1}/{runs[e.name]} | {e.label} | {_batch_text(batch, groups[batch])}"
                progress.begin(what)
                for _ in range(RETRIES_AFTER_COMPILE + 1):  # a repetition that compiled a program is no measure
                    compiles = e.num_compiles() if isinstance(e, WeldEngine) else 0
                    sums, produced, counts = time_workload(e, groups[batch], cfg.output_len)
                    if not isinstance(e, WeldEngine) or e.num_compiles() == compiles:
                        break
                    retried[e.name] += 1
                if counts is not None:
                    spec_counts[batch] = spec_add(spec_counts[batch], counts)
                outputs[e.name].setdefault(batch, produced)
                for key, value in sums.items():
                    raw[e.name]["decode"][batch][key].append(value)
                rate = decode_rate(sums["t_full"], sums["t_one"], sums["tokens_full"], sums["tokens_one"])
                progress.finish(what, sums["t_one"] + sums["t_full"], decode=(e.label, batch, rate))
        for e in order:
            if rep < runs[e.name]:
                what = f"timed run {rep + 1}/{runs[e.name]} | {e.label} | prefill {loaded.prefill_len} tokens"
                progress.begin(what)
                seconds = timed(lambda: e.generate(loaded.prefill_prompt, 1))[0]
                raw[e.name]["prefill_s"].append(seconds)
                progress.finish(what, seconds, prefill_tok_s=loaded.prefill_len / seconds)
    return raw, spec_counts, outputs, retried


def run(cfg: BenchConfig) -> dict:
    """Loads the engines, warms them up, runs the interleaved repetitions; returns the result dict."""
    from weld.weights import resolve_model

    started = datetime.datetime.now()
    load_start = os.getloadavg()
    source = resolve_model(cfg.model)
    if "llamacpp" in cfg.vs and source.kind != "gguf":
        raise InvalidInputError(f"--vs llamacpp needs a GGUF model; {source.name} is a HF directory")
    texts = read_prompts(cfg.prompts) if cfg.prompts else None
    text_prompts = encode_prompts(source, texts, cfg.chat) if texts else None
    show = progress_enabled()
    with status("Measuring memory bandwidth", enabled=show):
        bandwidth = measure_bandwidth(cfg.bandwidth_gb)

    loaded = load_engines(cfg, source, text_prompts, show)
    engines, prompts = loaded.engines, loaded.prompts
    groups = {batch: workload(prompts, batch, texts is not None) for batch in cfg.batch_sizes}
    runs = {e.name: cfg.vs_runs if e.name in cfg.vs else cfg.runs for e in engines}
    welds = [e for e in engines if isinstance(e, WeldEngine)]
    with BenchProgress(warm_up_steps(engines, cfg) + timed_steps(runs, cfg), enabled=show) as progress:
        warmup_s = warm_up(loaded, groups, cfg, progress)
        compiles_before = {e.name: e.num_compiles() for e in welds}
        raw, spec_counts, outputs, retried = timed_runs(loaded, groups, runs, cfg, progress)
    for e in engines:
        if hasattr(e, "close"):
            e.close()
    bandwidth_end = measure_bandwidth(cfg.bandwidth_gb, reps=3)

    input_len = round(statistics.mean(len(p) for p in prompts)) if texts else cfg.input_len  # the floor's context
    results = {}
    for e in engines:
        results[e.name] = summarize_engine(e, raw[e.name], cfg, input_len, loaded.prefill_len, bandwidth["used_gb_s"])
        results[e.name].update(load_s=loaded.load_s[e.name], warmup_s=warmup_s[e.name], runs=runs[e.name])
        if e in welds:
            results[e.name]["compiles_during_timed_runs"] = e.num_compiles() - compiles_before[e.name]
            results[e.name]["timed_runs_repeated_after_a_compile"] = retried[e.name]
        if e.name == SPEC_ENGINE:
            results[e.name]["spec_stats_end"] = e.spec_counters()  # warm-up included
    if 1 in cfg.batch_sizes:
        ref = outputs["weld"][1][0]
        for name in results:
            tokens = outputs[name][1][0]
            results[name]["greedy_batch1_agrees_with_weld_for"] = next(
                (i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), min(len(ref), len(tokens)))
    workload_info: dict[str, Any] = {"input_len": input_len}
    if texts:
        workload_info.update(prompts_file=cfg.prompts, num_prompts=len(prompts), chat=cfg.chat,
                             prompt_tokens=[len(p) for p in prompts], stop_at_eos=not cfg.ignore_eos)
    result = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join(["weld", *sys.argv[1:]]),
        "machine": machine_info(load_start),
        "versions": versions(),
        "config": {**dataclasses.asdict(cfg), "prefill_len": loaded.prefill_len, "model_source": str(source.path),
                   "model_name": source.name, "weld_max_model_len": loaded.model_len},
        "workload": workload_info,
        "bandwidth_start": bandwidth,
        "bandwidth_end": bandwidth_end,
        "engines": results,
        "ratios": ratios(results, cfg.batch_sizes),
        "note": "decode tok/s = (tokens of the full runs - tokens of the 1-token runs) / (t_full - t_one) per "
                "run (B * (out - 1) / (t_full - t_one) for random prompts), then the median over runs; "
                "floor_fraction = decode tok/s / (B * bandwidth / bytes per step)",
    }
    if cfg.spec is not None:
        result["speculative"] = speculative_summary(results, spec_counts, outputs, cfg)
    return result
