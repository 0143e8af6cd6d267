"""`weld bench`: offline throughput of the engine, side by side with HF transformers and llama.cpp.

    weld bench                                  # bundled SmolLM2-135M, batch 1,4,16,64, 128 in / 128 out
    weld bench --vs hf --vs llamacpp --runs 3   # the same prompts through the other engines, interleaved

What is measured (every engine gets the same random prompt token ids, greedy, exactly
`--output-len` new tokens whatever it samples):

- decode tok/s at batch B: B * (out - 1) / (t(out tokens) - t(1 token)). The 1-token run is
  prefill + first token, so the difference is the decode of the other out - 1 tokens per row.
- prefill tok/s: a `--prefill-len` prompt with max_tokens=1, prompt tokens / time.
- TTFT: the 1-token run at batch 1 and `--input-len`.
- fraction of the floor: decode is memory-bound, so a step cannot beat the bytes it must read
  (see `floor_bytes`) over the memory bandwidth, which is measured in the same run.

Medians of `--runs` repetitions; the engines' repetitions are interleaved so that a change in
background load hits them all alike. Raw times go to the JSON file. Nothing here is imported by
the engine: this module sits above it, like the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

from weld.utils.errors import InvalidInputError, WeldError
from weld.utils.progress import Progress, progress_enabled, status

ENGINES = ("hf", "llamacpp")  # what --vs accepts; weld always runs
DEFAULT_BATCH_SIZES = "1,4,16,64"
DEFAULT_PREFILL_LEN = 1024
LLAMACPP_HINT = "pip install llama-cpp-python (or pip install 'weld[bench]')"
HF_HINT = "pip install torch transformers accelerate (or pip install 'weld[test]')"


# ----- flags -----

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `weld bench` flags (the CLI stays thin: it only calls this and `main`)."""
    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="GGUF file, HF directory or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weld's weight and KV dtype; auto is float32 on CPU (default: auto)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, metavar="B,B,...",
                   help=f"decode batch sizes (default: {DEFAULT_BATCH_SIZES})")
    p.add_argument("--input-len", type=int, default=128, metavar="N", help="prompt tokens per row (default: 128)")
    p.add_argument("--output-len", type=int, default=128, metavar="N", help="new tokens per row (default: 128)")
    p.add_argument("--prefill-len", type=int, default=None, metavar="N",
                   help=f"prompt tokens of the prefill test (default: {DEFAULT_PREFILL_LEN}, "
                        "or the model's context - 1 if shorter)")
    p.add_argument("--runs", type=int, default=3, help="timed repetitions; medians are reported (default: 3)")
    p.add_argument("--vs", action="append", default=[], metavar="ENGINE",
                   help="also run hf (transformers, GGUF dequantized to f32) or llamacpp (llama-cpp-python, "
                        "same GGUF); repeatable")
    p.add_argument("--vs-runs", type=int, default=None, metavar="N",
                   help="cap the timed repetitions of the --vs engines (default: --runs)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="torch and llama.cpp threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids (default: 0)")
    p.add_argument("--bandwidth-gb", type=float, default=1.0, metavar="GB",
                   help="size of the array the memory bandwidth is measured on (default: 1.0)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="JSON result file (default: benchmarks/results/bench_<date>_<time>.json)")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str | None
    dtype: str
    batch_sizes: tuple[int, ...]
    input_len: int
    output_len: int
    prefill_len: int | None
    runs: int
    vs: tuple[str, ...]
    vs_runs: int
    threads: int
    seed: int
    bandwidth_gb: float
    out: str | None


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16): positive, distinct, kept in the given order."""
    sizes = []
    for part in text.split(","):
        part = part.strip()
        try:
            size = int(part)
        except ValueError:
            raise InvalidInputError(f"--batch-sizes: {part!r} is not an integer (expected e.g. 1,4,16,64)") from None
        if size < 1:
            raise InvalidInputError(f"--batch-sizes: batch sizes must be >= 1, got {size}")
        if size in sizes:
            raise InvalidInputError(f"--batch-sizes: {size} is listed twice")
        sizes.append(size)
    return tuple(sizes)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Checks every flag before anything slow is loaded."""
    def at_least(name: str, value: int | None, low: int) -> None:
        if value is not None and value < low:
            raise InvalidInputError(f"--{name} must be >= {low}, got {value}")

    at_least("input-len", args.input_len, 1)
    at_least("output-len", args.output_len, 2)  # decode time is t(out) - t(1): needs two tokens
    at_least("prefill-len", args.prefill_len, 1)
    at_least("runs", args.runs, 1)
    at_least("vs-runs", args.vs_runs, 1)
    at_least("threads", args.threads, 1)
    if not args.bandwidth_gb > 0:
        raise InvalidInputError(f"--bandwidth-gb must be > 0, got {args.bandwidth_gb}")
    vs = tuple(dict.fromkeys(args.vs))
    for engine in vs:
        if engine not in ENGINES:
            raise InvalidInputError(f"--vs: unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if "hf" in vs and not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        raise WeldError(f"--vs hf needs torch and transformers: {HF_HINT}")
    if "llamacpp" in vs and importlib.util.find_spec("llama_cpp") is None:
        raise WeldError(f"--vs llamacpp needs llama-cpp-python, which is not installed: {LLAMACPP_HINT}")
    return BenchConfig(model=args.model, dtype=args.dtype, batch_sizes=parse_batch_sizes(args.batch_sizes),
                       input_len=args.input_len, output_len=args.output_len, prefill_len=args.prefill_len,
                       runs=args.runs, vs=vs, vs_runs=min(args.vs_runs or args.runs, args.runs),
                       threads=args.threads, seed=args.seed, bandwidth_gb=args.bandwidth_gb, out=args.out)


# ----- the floor -----

def measure_bandwidth(gb: float = 1.0, reps: int = 5) -> dict:
    """Median GB/s of numpy passes over a ~`gb` GB float32 array: a copy (read + write bytes
    counted) and a sum (read bytes). The higher of the two is what the floor uses."""
    a = np.ones(int(gb * 1e9) // 4, np.float32)
    b = np.empty_like(a)
    b.fill(0)  # fault the pages in before timing

    def rate(fn: Callable[[], Any], nbytes: int) -> float:
        start = time.perf_counter()
        fn()
        return nbytes / (time.perf_counter() - start) / 1e9

    copy = [rate(lambda: np.copyto(b, a), 2 * a.nbytes) for _ in range(reps)]
    total = [rate(a.sum, a.nbytes) for _ in range(reps)]
    res = {"array_gb": a.nbytes / 1e9, "copy_gb_s": statistics.median(copy), "sum_gb_s": statistics.median(total),
           "copy_raw": copy, "sum_raw": total}
    res["used_gb_s"] = max(res["copy_gb_s"], res["sum_gb_s"])
    return res


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """What one engine's weights cost a decode step, in its own storage format."""

    total: int  # every weight tensor once (a tied embedding is stored, and counted, once)
    untied_embedding: int  # the input embedding table when a separate lm_head exists, else 0
    embedding_row: int  # bytes of one embedding row (a step gathers one per sequence)


def floor_bytes(weights: WeightBytes, kv_bytes_per_token: int, batch: int, input_len: int,
                output_len: int) -> dict:
    """Bytes one decode step at batch `batch` must read.

    Weights: all of them, once per step (the batch shares them). The lm_head is read whole,
    so a tied embedding counts in full; an untied input embedding is only gathered, one row per
    sequence. KV: every sequence reads its K and V of every layer for the tokens in context. The
    decode steps j = 1 .. out-1 run at context input_len + j, whose mean is input_len + out/2.
    """
    weight = weights.total - weights.untied_embedding
    if weights.untied_embedding:
        weight += batch * weights.embedding_row
    mean_context = input_len + output_len / 2
    kv = batch * kv_bytes_per_token * mean_context
    return {"weights": weight, "kv_mean": kv, "total": weight + kv, "mean_context": mean_context}


# ----- engines: each takes lists of token ids and returns exactly max_tokens greedy ids per row -----

class WeldEngine:
    name = "weld"

    def __init__(self, model: str, dtype: str, max_batch: int, max_model_len: int, decode_len: int | None = None):
        from weld.engine.llm import LLM
        from weld.engine.sampling_params import SamplingParams

        page_size = 16
        # Every row of the largest batch at its full length (decode_len: prompt + new tokens), or
        # the one long prefill prompt, plus a page per row of slack for pages the fused decode
        # allocates ahead. No prefix caching: the same prompts repeat across runs and must be
        # recomputed each time. (Attention reads only the pages in context, so the pool's size
        # costs memory, not time.)
        pages = lambda tokens: -(-tokens // page_size) + 1  # noqa: E731
        num_pages = max(max_batch * pages(decode_len or max_model_len), pages(max_model_len))
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_batch,
                       page_size=page_size, num_pages=num_pages, enable_prefix_caching=False)
        self._params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
        self.cfg = self.llm.cfg
        self.max_model_len = self.llm.max_model_len
        dtype_name = np.dtype(self.llm.dtype).name
        self.label = f"weld {dtype_name}"
        import jax

        leaves = jax.tree_util.tree_leaves(self.llm.model.weights)
        embed = self.llm.model.weights.get("embed")
        untied = embed is not None and "lm_head" in self.llm.model.weights
        self.weight_bytes = WeightBytes(total=sum(x.nbytes for x in leaves),
                                        untied_embedding=embed.nbytes if untied else 0,
                                        embedding_row=embed.nbytes // embed.shape[0] if embed is not None else 0)
        self.kv_bytes_per_token = self.cfg.kv_spec.bytes_per_token(self.llm.dtype)
        self.info = {"dtype": dtype_name, "backend": jax.default_backend(), "batching": "continuous batching",
                     "kv_dtype": dtype_name}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self._params(max_tokens),
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HFEngine:
    """transformers on torch (CPU), f32: a GGUF is dequantized by transformers itself."""

    name = "hf"

    def __init__(self, source, threads: int, weld_cfg):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(threads)  # a benchmark, not a test: all the cores
        self.torch = torch
        if source.kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                         dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
        self.model = model.eval()
        cfg = model.config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else 0
        self.eos = eos if isinstance(eos, int) else list(eos)[0]
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.eos
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        untied = head is not None and head.weight.data_ptr() != embed.data_ptr()
        self.weight_bytes = WeightBytes(
            total=sum(p.numel() * p.element_size() for p in model.parameters()),  # tied shared once
            untied_embedding=embed.numel() * embed.element_size() if untied else 0,
            embedding_row=embed.shape[1] * embed.element_size())
        self.kv_bytes_per_token = weld_cfg.kv_spec.bytes_per_token(np.float32)  # the cache is in the model's dtype
        self.label = "HF f32"
        self.info = {"dtype": "float32", "torch_threads": threads, "batching": "padded batch (left padding, "
                     "attention mask)", "kv_dtype": "float32", "transformers": transformers.__version__,
                     "torch": torch.__version__}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from transformers import GenerationConfig

        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        gen = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                               pad_token_id=self.pad, eos_token_id=self.eos)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=gen)
        return out[:, width:].tolist()


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level API: one llama_batch holds a token of every
    sequence (one sequence id per row, each with its own KV cells), so batch B decodes B rows per
    call, at every B (batch 1 included). Greedy is an argmax over the returned logits."""

    name = "llamacpp"

    def __init__(self, path: pathlib.Path, max_batch: int, max_model_len: int, threads: int, cfg):
        import logging

        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load log goes to stderr
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise WeldError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        self.n_batch = 2048
        params.n_ctx = max_batch * -(-max_model_len // 256) * 256  # llama.cpp pads each sequence's cells to 256
        params.n_batch = self.n_batch
        params.n_ubatch = 512
        params.n_seq_max = max_batch
        # Per-sequence KV cells: a unified cache would make every row attend over (masked) cells
        # of all rows, which llama.h advises against when sequences share no prefix.
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise WeldError(f"llama.cpp could not create a context of {params.n_ctx} tokens x {max_batch} sequences")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.weight_bytes = gguf_weight_bytes(path)
        self.kv_bytes_per_token = cfg.kv_spec.bytes_per_token(np.float16)  # llama.cpp's default K/V type
        file_type = path.stem.rsplit(".", 1)[-1] if "." in path.stem else "GGUF"
        self.label = f"llama.cpp {file_type}"
        self.info = {"dtype": file_type, "threads": threads, "kv_dtype": "float16",
                     "batching": "llama_batch API (one batch of all sequences per step)",
                     "llama_cpp_python": importlib.metadata.version("llama_cpp_python")}

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most n_batch of them."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax_outputs(self, n: int) -> list[int]:
        """Greedy tokens of the n rows that asked for logits in the last decode, in batch order."""
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n * self.n_vocab,))
        return logits.reshape(n, self.n_vocab).argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        # Prefill: all prompts' tokens packed into batches of n_batch; the last token of each
        # prompt asks for logits, read right after the batch that holds it.
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        outs: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start:start + self.n_batch]
            self._decode(chunk)
            seqs = [seq for _, _, seq, logits in chunk if logits]
            for seq, token in zip(seqs, self._argmax_outputs(len(seqs))):
                outs[seq].append(token)
        for step in range(1, max_tokens):
            self._decode([(outs[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s, token in enumerate(self._argmax_outputs(len(prompts))):
                outs[s].append(token)
        return outs


def gguf_weight_bytes(path: pathlib.Path) -> WeightBytes:
    """Tensor bytes of a GGUF as stored (quantized blocks included)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    embed = tensors.get("token_embd.weight")
    untied = embed is not None and "output.weight" in tensors
    rows = int(embed.shape[-1]) if embed is not None else 1  # GGUF lists dims innermost first
    return WeightBytes(total=sum(int(t.n_bytes) for t in tensors.values()),
                       untied_embedding=int(embed.n_bytes) if untied else 0,
                       embedding_row=int(embed.n_bytes) // rows if embed is not None else 0)


# ----- the run -----

def make_prompts(vocab_size: int, rows: int, length: int, seed: int) -> list[list[int]]:
    """Fixed random token ids: the same for every engine and every run with this seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(rows, length)).tolist()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _check_lengths(engine, outs: list[list[int]], rows: int, max_tokens: int) -> None:
    if len(outs) != rows or any(len(o) != max_tokens for o in outs):
        raise RuntimeError(f"{engine.name} returned {[len(o) for o in outs]} tokens for {rows} rows of {max_tokens}")


def run(cfg: BenchConfig) -> dict:
    """Loads the engines, warms them up, runs the interleaved repetitions; returns the result dict."""
    from weld.weights import resolve_model

    started = datetime.datetime.now()
    load_start = os.getloadavg()
    source = resolve_model(cfg.model)
    if "llamacpp" in cfg.vs and source.kind != "gguf":
        raise InvalidInputError(f"--vs llamacpp needs a GGUF model; {source.name} is a HF directory")
    show = progress_enabled()
    with status("Measuring memory bandwidth", enabled=show):
        bandwidth = measure_bandwidth(cfg.bandwidth_gb)

    max_batch = max(cfg.batch_sizes)
    wanted_prefill = cfg.prefill_len or DEFAULT_PREFILL_LEN
    wanted_len = max(cfg.input_len + cfg.output_len, wanted_prefill + 1)
    engines: list[Any] = []
    load_s: dict[str, float] = {}
    with status("Loading weld", enabled=show):
        t, weld = timed(lambda: WeldEngine(str(source.path), cfg.dtype, max_batch, wanted_len,
                                               decode_len=cfg.input_len + cfg.output_len))
    engines.append(weld)
    load_s[weld.name] = t
    if cfg.input_len + cfg.output_len > weld.max_model_len:
        raise InvalidInputError(f"--input-len {cfg.input_len} + --output-len {cfg.output_len} exceeds the model's "
                                f"context of {weld.max_model_len} tokens")
    if cfg.prefill_len is not None and cfg.prefill_len + 1 > weld.max_model_len:
        raise InvalidInputError(f"--prefill-len {cfg.prefill_len} + 1 exceeds the model's context of "
                                f"{weld.max_model_len} tokens")
    prefill_len = cfg.prefill_len or min(DEFAULT_PREFILL_LEN, weld.max_model_len - 1)
    model_len = max(cfg.input_len + cfg.output_len, prefill_len + 1)
    if "hf" in cfg.vs:
        with status("Loading HF transformers (dequantizing to f32)", enabled=show):
            t, hf = timed(lambda: HFEngine(source, cfg.threads, weld.cfg))
        engines.append(hf)
        load_s[hf.name] = t
    if "llamacpp" in cfg.vs:
        with status("Loading llama.cpp", enabled=show):
            t, lcpp = timed(lambda: LlamaCppEngine(source.path, max_batch, model_len, cfg.threads, weld.cfg))
        engines.append(lcpp)
        load_s[lcpp.name] = t

    vocab = weld.cfg.vocab_size
    prompts = make_prompts(vocab, max_batch, cfg.input_len, cfg.seed)
    prefill_prompt = make_prompts(vocab, 1, prefill_len, cfg.seed + 1)
    runs = {e.name: cfg.runs if e.name == "weld" else cfg.vs_runs for e in engines}

    # Warm-up (untimed): weld compiles a program per bucket, so it runs every batch size; the
    # others warm their allocators and caches at batch 1.
    warmup_s: dict[str, float] = {}
    for e in engines:
        with status(f"Warming up {e.label}", enabled=show):
            start = time.perf_counter()
            sizes = cfg.batch_sizes if e.name == "weld" else (1,)
            for batch in sizes:
                e.generate(prompts[:batch], min(cfg.output_len, 24))
                e.generate(prompts[:batch], 1)
            e.generate(prefill_prompt, 1)
            warmup_s[e.name] = time.perf_counter() - start

    raw = {e.name: {"decode": {b: {"t_full": [], "t_one": []} for b in cfg.batch_sizes}, "prefill_s": []}
           for e in engines}
    greedy_batch1: dict[str, list[int]] = {}
    total = sum(runs[e.name] * (2 * len(cfg.batch_sizes) + 1) for e in engines)
    with Progress(total, "Benchmarking", unit="run", enabled=show) as bar:
        for rep in range(cfg.runs):
            # Interleaved: for each workload, every engine runs it before the next workload starts.
            for batch in cfg.batch_sizes:
                for e in engines:
                    if rep >= runs[e.name]:
                        continue
                    t_one, outs = timed(lambda: e.generate(prompts[:batch], 1))
                    _check_lengths(e, outs, batch, 1)
                    t_full, outs = timed(lambda: e.generate(prompts[:batch], cfg.output_len))
                    _check_lengths(e, outs, batch, cfg.output_len)
                    if batch == 1:
                        greedy_batch1[e.name] = outs[0]
                    raw[e.name]["decode"][batch]["t_one"].append(t_one)
                    raw[e.name]["decode"][batch]["t_full"].append(t_full)
                    bar.update(2)
            for e in engines:
                if rep < runs[e.name]:
                    raw[e.name]["prefill_s"].append(timed(lambda: e.generate(prefill_prompt, 1))[0])
                    bar.update(1)
    for e in engines:
        if hasattr(e, "close"):
            e.close()
    bandwidth_end = measure_bandwidth(cfg.bandwidth_gb, reps=3)
    bw = bandwidth["used_gb_s"]

    results = {}
    for e in engines:
        results[e.name] = summarize_engine(e, raw[e.name], cfg, prefill_len, bw)
        results[e.name].update(load_s=load_s[e.name], warmup_s=warmup_s[e.name], runs=runs[e.name])
    if 1 in cfg.batch_sizes:
        ref = greedy_batch1.get("weld", [])
        for name, tokens in greedy_batch1.items():
            results[name]["greedy_batch1_agrees_with_weld_for"] = next(
                (i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), min(len(ref), len(tokens)))
    return {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join(["weld", *sys.argv[1:]]),
        "machine": machine_info(load_start),
        "versions": versions(),
        "config": {**dataclasses.asdict(cfg), "prefill_len": prefill_len, "model_source": str(source.path),
                   "model_name": source.name, "weld_max_model_len": model_len},
        "bandwidth_start": bandwidth,
        "bandwidth_end": bandwidth_end,
        "engines": results,
        "ratios": ratios(results, cfg.batch_sizes),
        "note": "decode tok/s = B * (out - 1) / (t_full - t_one) per run, then the median over runs; "
                "floor_fraction = decode tok/s / (B * bandwidth / bytes per step)",
    }


def summarize_engine(engine, raw: dict, cfg: BenchConfig, prefill_len: int, bw_gb_s: float) -> dict:
    decode = {}
    for batch, times in raw["decode"].items():
        if not times["t_full"]:
            continue
        per_run = [batch * (cfg.output_len - 1) / (f - o) if f > o else None
                   for f, o in zip(times["t_full"], times["t_one"])]
        valid = [r for r in per_run if r is not None]
        tok_s = statistics.median(valid) if valid else None
        step_bytes = floor_bytes(engine.weight_bytes, engine.kv_bytes_per_token, batch, cfg.input_len, cfg.output_len)
        floor_tok_s = batch * bw_gb_s * 1e9 / step_bytes["total"]
        decode[str(batch)] = {
            "t_full_s": times["t_full"], "t_one_s": times["t_one"], "tok_s_per_run": per_run, "tok_s": tok_s,
            "bytes_per_step": step_bytes, "floor_tok_s": floor_tok_s,
            "floor_fraction": tok_s / floor_tok_s if tok_s else None,
        }
    prefill_s = statistics.median(raw["prefill_s"]) if raw["prefill_s"] else None
    first = raw["decode"].get(1)
    ttft = statistics.median(first["t_one"]) if first and first["t_one"] else None
    return {
        "label": engine.label, **engine.info,
        "weight_bytes": dataclasses.asdict(engine.weight_bytes),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "decode": decode,
        "prefill": {"tokens": prefill_len, "t_s": raw["prefill_s"], "median_s": prefill_s,
                    "tok_s": prefill_len / prefill_s if prefill_s else None},
        "ttft_s": ttft,
    }


def ratios(results: dict, batch_sizes: tuple[int, ...]) -> dict:
    """weld / other, as speeds (above 1: weld is faster); TTFT as other's time / weld's."""
    weld = results["weld"]
    out = {}
    for name, other in results.items():
        if name == "weld":
            continue

        def ratio(a, b):
            return a / b if a and b else None

        out[f"weld/{name}"] = {
            "decode": {b: ratio(weld["decode"][b]["tok_s"], other["decode"][b]["tok_s"])
                       for b in map(str, batch_sizes) if b in other["decode"]},
            "prefill": ratio(weld["prefill"]["tok_s"], other["prefill"]["tok_s"]),
            "ttft": ratio(other["ttft_s"], weld["ttft_s"]),
        }
    return out


def machine_info(load_start: tuple[float, float, float]) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal")), None)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "memory_bytes": mem,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "hostname": platform.node()}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for package in ("weld", "jax", "jaxlib", "numpy", "torch", "transformers", "llama_cpp_python"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    try:
        root = pathlib.Path(__file__).resolve().parents[1]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            out["weld_git"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


# ----- report -----

def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(result: dict) -> str:
    """The result as a plain-text table: one column per engine, then weld/other ratios."""
    engines = result["engines"]
    names = list(engines)
    others = [n for n in names if n != "weld"]
    cfg = result["config"]
    bw = result["bandwidth_start"]
    lines = [
        f"weld bench: {cfg['model_name']}, prompt {cfg['input_len']} tokens, {cfg['output_len']} new, greedy; "
        f"median of {cfg['runs']} run{'s' if cfg['runs'] > 1 else ''}" + (f" ({cfg['vs_runs']} for {', '.join(others)})"
                                            if others and cfg['vs_runs'] != cfg['runs'] else ""),
        f"memory bandwidth {bw['used_gb_s']:.1f} GB/s (numpy on {bw['array_gb']:.1f} GB: copy {bw['copy_gb_s']:.1f} "
        f"r+w, sum {bw['sum_gb_s']:.1f}); at the end {result['bandwidth_end']['used_gb_s']:.1f} GB/s",
    ]
    for n in names:
        e = engines[n]
        extra = f", {e['torch_threads']} torch threads" if "torch_threads" in e else (
            f", {e['threads']} threads" if "threads" in e else "")
        lines.append(f"  {e['label']:<18} {e['batching']}{extra}; KV {e['kv_dtype']}; "
                     f"{e['weight_bytes']['total'] / 1e6:.3g} MB of weights")
    width = max(14, *(len(engines[n]["label"]) + 2 for n in names))
    head = f"{'':24}" + "".join(f"{engines[n]['label']:>{width}}" for n in names) + "".join(
        f"{'weld/' + engines[n]['label'].split()[0]:>{width}}" for n in others)
    lines += ["", head, "-" * len(head)]
    ratio = result["ratios"]
    for b in map(str, cfg["batch_sizes"]):
        row = f"{'decode tok/s, batch ' + b:24}" + "".join(
            f"{_fmt(engines[n]['decode'].get(b, {}).get('tok_s'), '.1f'):>{width}}" for n in names)
        row += "".join(f"{_fmt(ratio[f'weld/{n}']['decode'].get(b), '.2f', 'x'):>{width}}" for n in others)
        lines.append(row)
    for b in map(str, cfg["batch_sizes"]):
        fractions = [engines[n]["decode"].get(b, {}).get("floor_fraction") for n in names]
        lines.append(f"{'% of floor, batch ' + b:24}" + "".join(
            f"{_fmt(f and 100 * f, '.0f', '%'):>{width}}" for f in fractions))
    lines.append(f"{'prefill tok/s, ' + str(cfg['prefill_len']):24}" + "".join(
        f"{_fmt(engines[n]['prefill']['tok_s'], '.0f'):>{width}}" for n in names) + "".join(
        f"{_fmt(ratio[f'weld/{n}']['prefill'], '.2f', 'x'):>{width}}" for n in others))
    lines.append(f"{'TTFT ms, batch 1':24}" + "".join(
        f"{_fmt(engines[n]['ttft_s'] and 1e3 * engines[n]['ttft_s'], '.1f'):>{width}}" for n in names) + "".join(
        f"{_fmt(ratio[f'weld/{n}']['ttft'], '.2f', 'x'):>{width}}" for n in others))
    lines.append(f"{'load s':24}" + "".join(f"{engines[n]['load_s']:>{width}.1f}" for n in names))
    lines.append("")
    lines.append("decode tok/s: aggregate over the batch, B * (out - 1) / (t(out tokens) - t(1 token)); "
                 "% of floor: of B * bandwidth / bytes read per step (all weights in the engine's format + the "
                 "mean KV in context); ratios above 1: weld is faster (TTFT: other's time / weld's).")
    load = result["machine"]
    lines.append(f"load average (1 min) {load['loadavg_start'][0]:.2f} at start, {load['loadavg_end'][0]:.2f} at end, "
                 f"on {load['cpu_count']} cores: above ~0.5, other work shared the machine.")
    return "\n".join(lines)


def default_out_path(now: datetime.datetime) -> pathlib.Path:
    return pathlib.Path("benchmarks") / "results" / f"bench_{now:%Y-%m-%d_%H%M%S}.json"


def main(args: argparse.Namespace) -> int:
    """`weld bench`: validates the flags, runs, prints the table, writes the JSON."""
    cfg = config_from_args(args)
    out = pathlib.Path(cfg.out) if cfg.out else default_out_path(datetime.datetime.now())
    if out.exists() and out.is_dir():
        raise InvalidInputError(f"--out {out} is a directory; give a file path")
    result = run(cfg)
    print(format_table(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0
