"""`weld bench`: offline throughput of the engine, side by side with HF transformers and llama.cpp.

    weld bench                                  # bundled SmolLM2-135M, batch 1,4,16,64, 128 in / 128 out
    weld bench --vs hf --vs llamacpp --runs 3   # the same prompts through the other engines, interleaved
    weld bench --spec ngram --prompts benchmarks/prompts/copy_edit.txt --chat --batch-sizes 1
                                                # weld with and without n-gram speculation, interleaved

What is measured (every engine gets the same random prompt token ids, greedy, exactly
`--output-len` new tokens whatever it samples; with `--prompts FILE`, the file's texts, one per
line, stopping at EOS unless `--ignore-eos`, so that the model does the task it was asked):

- decode tok/s at batch B: B * (out - 1) / (t(out tokens) - t(1 token)). The 1-token run is
  prefill + first token, so the difference is the decode of the other out - 1 tokens per row.
  With --prompts the prompts run in groups of B and the tokens are those actually produced:
  (tokens of the full runs - tokens of the 1-token runs) / (sum of t_full - sum of t_one).
- prefill tok/s: a `--prefill-len` prompt with max_tokens=1, prompt tokens / time.
- TTFT: the 1-token run at batch 1 and `--input-len`.
- fraction of the floor: decode is memory-bound, so a step cannot beat the bytes it must read
  (see `floor_bytes`) over the memory bandwidth, which is measured in the same run. A speculative
  engine can pass 100%: one verification step reads the weights once for up to k + 1 tokens
  (its floor counts the target's weights only, not a draft model's).
- with --spec: a second weld engine with speculative decoding runs every workload right after
  (or, every other repetition, right before) the plain one; the report adds its speedup and its
  acceptance (mean acceptance length, per-position rates) counted over the timed full runs only.

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
DEFAULT_SPEC_BATCH_SIZES = "1,4"  # with --spec or --prompts: speculation pays off at small batches
DEFAULT_PREFILL_LEN = 1024
LLAMACPP_HINT = "pip install llama-cpp-python (or pip install 'weld[bench]')"
HF_HINT = "pip install torch transformers accelerate (or pip install 'weld[test]')"
SPEC_ENGINE = "weld-spec"  # the name of the speculative weld engine in results


# ----- speculative decoding flags: shared by weld generate, chat, serve and bench -----

SPEC_METHODS = {"ngram": "ngram", "draft": "draft_model", "dspark": "dspark"}  # flag -> speculative_config method
DEFAULT_SPEC_K = 4
DEFAULT_NGRAM_MIN, DEFAULT_NGRAM_MAX = 1, 3  # the engine's prompt_lookup_min / _max defaults


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """--spec, --spec-k, --draft, --spec-ngram-min, --spec-ngram-max (read by `speculative_config`)."""
    g = p.add_argument_group("speculative decoding (greedy outputs stay the same; sampled ones keep their "
                             "distribution)")
    g.add_argument("--spec", default=None, choices=list(SPEC_METHODS),
                   help="draft tokens cheaply and verify them in one step of the model: ngram (look up the "
                        "context's last n-gram earlier in the context), draft (a smaller model with the same "
                        "tokenizer: --draft), dspark (a DSpark drafter from weld train-draft: --draft) (default: off)")
    g.add_argument("--spec-k", type=int, default=None, metavar="N",
                   help=f"most drafted tokens per step (default: {DEFAULT_SPEC_K})")
    g.add_argument("--draft", default=None, metavar="PATH",
                   help="--spec draft: the draft model (GGUF file or HF directory); --spec dspark: the drafter "
                        "directory")
    g.add_argument("--spec-ngram-min", type=int, default=None, metavar="N",
                   help=f"--spec ngram: shortest n-gram looked up (default: {DEFAULT_NGRAM_MIN})")
    g.add_argument("--spec-ngram-max", type=int, default=None, metavar="N",
                   help=f"--spec ngram: longest n-gram looked up, tried first (default: {DEFAULT_NGRAM_MAX})")


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The speculative flags as `LLM(speculative_config=...)` (vLLM's keys), None without --spec.

    Combinations that make no sense are one-line errors; value ranges the engine checks itself
    (before it loads anything)."""
    ngram_flags = [flag for flag, value in (("--spec-ngram-min", args.spec_ngram_min),
                                            ("--spec-ngram-max", args.spec_ngram_max)) if value is not None]
    if args.spec is None:
        given = [flag for flag, value in (("--spec-k", args.spec_k), ("--draft", args.draft)) if value is not None]
        if given or ngram_flags:
            raise InvalidInputError(f"{(given + ngram_flags)[0]} needs --spec ngram, draft or dspark")
        return None
    k = DEFAULT_SPEC_K if args.spec_k is None else args.spec_k
    if k < 1:
        raise InvalidInputError(f"--spec-k must be >= 1, got {k}")
    config: dict[str, Any] = {"method": SPEC_METHODS[args.spec], "num_speculative_tokens": k}
    if args.spec == "ngram":
        if args.draft is not None:
            raise InvalidInputError("--draft is for --spec draft or --spec dspark; --spec ngram drafts from the "
                                    "context")
        low = DEFAULT_NGRAM_MIN if args.spec_ngram_min is None else args.spec_ngram_min
        high = DEFAULT_NGRAM_MAX if args.spec_ngram_max is None else args.spec_ngram_max
        if not 1 <= low <= high:
            raise InvalidInputError(f"need 1 <= --spec-ngram-min <= --spec-ngram-max, got {low} and {high}")
        return config | {"prompt_lookup_min": low, "prompt_lookup_max": high}
    if ngram_flags:
        raise InvalidInputError(f"{ngram_flags[0]} is for --spec ngram, not --spec {args.spec}")
    if args.draft is None:
        what = "a draft model (GGUF file or HF directory)" if args.spec == "draft" else "a DSpark drafter directory"
        raise InvalidInputError(f"--spec {args.spec} needs --draft PATH: {what}")
    return config | {"model": args.draft}


# ----- flags -----

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `weld bench` flags (the CLI stays thin: it only calls this and `main`)."""
    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="GGUF file, HF directory or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weld's weight and KV dtype; auto is float32 on CPU (default: auto)")
    p.add_argument("--batch-sizes", default=None, metavar="B,B,...",
                   help=f"decode batch sizes (default: {DEFAULT_BATCH_SIZES}; {DEFAULT_SPEC_BATCH_SIZES} with "
                        "--spec or --prompts)")
    p.add_argument("--input-len", type=int, default=128, metavar="N", help="prompt tokens per row (default: 128)")
    p.add_argument("--output-len", type=int, default=128, metavar="N",
                   help="new tokens per row; with --prompts the most new tokens (default: 128)")
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
    g = p.add_argument_group("text prompts (instead of --input-len random token ids; weld only)")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="a text file, one prompt per line (blank lines skipped); at batch B the prompts run "
                        "in groups of B, greedy, up to --output-len new tokens, stopping at EOS")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the model's chat template")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --output-len tokens per prompt, past EOS (default: stop at EOS)")
    add_speculative_arguments(p)


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
    prompts: str | None = None  # a text file, one prompt per line
    chat: bool = False
    ignore_eos: bool = False  # text prompts only: random ones always ignore EOS
    spec: dict[str, Any] | None = None  # speculative_config of the second weld engine


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of `path` (newline stripped, nothing else)."""
    try:
        lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InvalidInputError(f"--prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidInputError(f"--prompts {path}: cannot read it ({err})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise InvalidInputError(f"--prompts {path} holds no prompt (one per line)")
    return prompts


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
    if args.prompts is None and (args.chat or args.ignore_eos):
        raise InvalidInputError(f"{'--chat' if args.chat else '--ignore-eos'} is for --prompts FILE "
                                "(random token prompts have no chat template and always ignore EOS)")
    if args.prompts is not None and vs:
        raise InvalidInputError("--prompts runs weld only; --vs engines take the random token prompts")
    spec = speculative_config(args)
    if spec is not None:
        from weld.engine.llm import SpeculativeConfig

        SpeculativeConfig.parse(spec)  # the engine's own checks, before anything slow
    default_sizes = DEFAULT_SPEC_BATCH_SIZES if spec is not None or args.prompts else DEFAULT_BATCH_SIZES
    batch_sizes = parse_batch_sizes(args.batch_sizes or default_sizes)
    if args.prompts is not None:
        count = len(read_prompts(args.prompts))
        if max(batch_sizes) > count:
            raise InvalidInputError(f"--batch-sizes: batch {max(batch_sizes)} exceeds the {count} prompts "
                                    f"in {args.prompts}")
    if "hf" in vs and not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        raise WeldError(f"--vs hf needs torch and transformers: {HF_HINT}")
    if "llamacpp" in vs and importlib.util.find_spec("llama_cpp") is None:
        raise WeldError(f"--vs llamacpp needs llama-cpp-python, which is not installed: {LLAMACPP_HINT}")
    return BenchConfig(model=args.model, dtype=args.dtype, batch_sizes=batch_sizes,
                       input_len=args.input_len, output_len=args.output_len, prefill_len=args.prefill_len,
                       runs=args.runs, vs=vs, vs_runs=min(args.vs_runs or args.runs, args.runs),
                       threads=args.threads, seed=args.seed, bandwidth_gb=args.bandwidth_gb, out=args.out,
                       prompts=args.prompts, chat=args.chat, ignore_eos=args.ignore_eos, spec=spec)


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


# ----- engines: each takes lists of token ids and returns max_tokens greedy ids per row (exactly, unless a
# weld engine was told to stop at EOS) -----

class WeldEngine:
    """weld through its public API. `speculative_config` makes it the speculative engine;
    `ignore_eos=False` (text prompts) lets rows stop at EOS, so they may return fewer tokens."""

    def __init__(self, model: str, dtype: str, max_batch: int, max_model_len: int, decode_len: int | None = None,
                 speculative_config: dict[str, Any] | None = None, ignore_eos: bool = True):
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
                       page_size=page_size, num_pages=num_pages, enable_prefix_caching=False,
                       speculative_config=speculative_config)
        self._params = lambda n: SamplingParams(max_tokens=n, ignore_eos=ignore_eos, temperature=0)
        self.ignore_eos = ignore_eos
        self.cfg = self.llm.cfg
        self.max_model_len = self.llm.max_model_len
        dtype_name = np.dtype(self.llm.dtype).name
        self.name, self.label = "weld", f"weld {dtype_name}"
        if speculative_config:
            method = speculative_config["method"].removesuffix("_model")
            self.name = SPEC_ENGINE
            self.label = f"{self.label} {method} k{speculative_config['num_speculative_tokens']}"
        import jax

        leaves = jax.tree_util.tree_leaves(self.llm.model.weights)
        embed = self.llm.model.weights.get("embed")
        untied = embed is not None and "lm_head" in self.llm.model.weights
        self.weight_bytes = WeightBytes(total=sum(x.nbytes for x in leaves),
                                        untied_embedding=embed.nbytes if untied else 0,
                                        embedding_row=embed.nbytes // embed.shape[0] if embed is not None else 0)
        self.kv_bytes_per_token = self.cfg.kv_spec.bytes_per_token(self.llm.dtype)
        self.info = {"dtype": dtype_name, "backend": jax.default_backend(), "batching": "continuous batching",
                     "kv_dtype": dtype_name, "max_model_len": self.max_model_len, "page_size": page_size,
                     "num_pages": num_pages, "ignore_eos": ignore_eos, "speculative_config": speculative_config}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self._params(max_tokens),
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def spec_counters(self) -> dict[str, Any]:
        """The engine's cumulative speculative counters ({} without speculation)."""
        return self.llm.engine.spec_stats()

    def num_compiles(self) -> int:
        return self.llm.engine.stats()["num_compiles"]


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
    exact = getattr(engine, "ignore_eos", True)
    if len(outs) != rows or any(len(o) != max_tokens if exact else not 1 <= len(o) <= max_tokens for o in outs):
        raise RuntimeError(f"{engine.name} returned {[len(o) for o in outs]} tokens for {rows} rows of "
                           f"{'' if exact else 'at most '}{max_tokens}")


SPEC_COUNTERS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
SPEC_LISTS = ("spec_drafted_per_position", "spec_accepted_per_position")


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engine's cumulative speculative counters gained between two snapshots."""
    delta: dict[str, Any] = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    for key in SPEC_LISTS:
        delta[key] = [a - b for a, b in zip(after[key], before[key])]
    return delta


def spec_add(total: dict[str, Any] | None, delta: dict[str, Any]) -> dict[str, Any]:
    if total is None:
        return delta
    return {key: [a + b for a, b in zip(total[key], delta[key])] if key in SPEC_LISTS else total[key] + delta[key]
            for key in delta}


def acceptance(counts: dict[str, Any]) -> dict[str, Any]:
    """Rates from summed counters. A draft is a row-step that verified >= 1 drafted token; its
    acceptance length is 1 + the drafts accepted (the target's own token always comes out), so the
    mean acceptance length is 1 + accepted / drafts. Position j's rate is accepted / drafted in
    slot j (an n-gram proposal may send fewer than k drafts)."""
    drafts, drafted, accepted = (counts[key] for key in SPEC_COUNTERS)
    return {
        "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "drafted_per_position": counts["spec_drafted_per_position"],
        "accepted_per_position": counts["spec_accepted_per_position"],
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_rate": [a / d if d else None for a, d in zip(counts["spec_accepted_per_position"],
                                                                    counts["spec_drafted_per_position"])],
    }


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


def run(cfg: BenchConfig) -> dict:
    """Loads the engines, warms them up, runs the interleaved repetitions; returns the result dict."""
    from weld.weights import resolve_model

    started = datetime.datetime.now()
    load_start = os.getloadavg()
    source = resolve_model(cfg.model)
    if "llamacpp" in cfg.vs and source.kind != "gguf":
        raise InvalidInputError(f"--vs llamacpp needs a GGUF model; {source.name} is a HF directory")
    texts = read_prompts(cfg.prompts) if cfg.prompts else None
    if texts:
        prompts = encode_prompts(source, texts, cfg.chat)
        decode_len = max(len(p) for p in prompts) + cfg.output_len
        input_len = round(statistics.mean(len(p) for p in prompts))  # for the floor's mean context
    else:
        decode_len = cfg.input_len + cfg.output_len
        input_len = cfg.input_len
    show = progress_enabled()
    with status("Measuring memory bandwidth", enabled=show):
        bandwidth = measure_bandwidth(cfg.bandwidth_gb)

    max_batch = max(cfg.batch_sizes)
    wanted_prefill = cfg.prefill_len or DEFAULT_PREFILL_LEN
    wanted_len = max(decode_len, wanted_prefill + 1)
    ignore_eos = cfg.ignore_eos or not texts
    engines: list[Any] = []
    load_s: dict[str, float] = {}

    def load_weld(spec: dict[str, Any] | None, what: str) -> Any:
        with status(f"Loading {what}", enabled=show):
            t, engine = timed(lambda: WeldEngine(str(source.path), cfg.dtype, max_batch, wanted_len, decode_len,
                                                 speculative_config=spec, ignore_eos=ignore_eos))
        engines.append(engine)
        load_s[engine.name] = t
        return engine

    weld = load_weld(None, "weld")
    if decode_len > weld.max_model_len:
        what = (f"the longest prompt of {cfg.prompts} ({decode_len - cfg.output_len} tokens)" if texts
                else f"--input-len {cfg.input_len}")
        raise InvalidInputError(f"{what} + --output-len {cfg.output_len} exceeds the model's context of "
                                f"{weld.max_model_len} tokens")
    if not texts:
        prompts = make_prompts(weld.cfg.vocab_size, max_batch, cfg.input_len, cfg.seed)
    if cfg.prefill_len is not None and cfg.prefill_len + 1 > weld.max_model_len:
        raise InvalidInputError(f"--prefill-len {cfg.prefill_len} + 1 exceeds the model's context of "
                                f"{weld.max_model_len} tokens")
    prefill_len = cfg.prefill_len or min(DEFAULT_PREFILL_LEN, weld.max_model_len - 1)
    model_len = max(decode_len, prefill_len + 1)
    if cfg.spec is not None:
        load_weld(cfg.spec, f"weld with {cfg.spec['method']} speculation")
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

    prefill_prompt = make_prompts(weld.cfg.vocab_size, 1, prefill_len, cfg.seed + 1)
    groups = {batch: workload(prompts, batch, texts is not None) for batch in cfg.batch_sizes}
    runs = {e.name: cfg.vs_runs if e.name in cfg.vs else cfg.runs for e in engines}
    welds = [e for e in engines if isinstance(e, WeldEngine)]

    # Warm-up (untimed): weld compiles a program per bucket, so it runs every batch size (every
    # group of text prompts: their lengths fall in different buckets); the others warm their
    # allocators and caches at batch 1.
    warmup_s: dict[str, float] = {}
    for e in engines:
        with status(f"Warming up {e.label}", enabled=show):
            start = time.perf_counter()
            sizes = cfg.batch_sizes if e in welds else (1,)
            for batch in sizes:
                for group in groups[batch] if e in welds else groups[batch][:1]:
                    e.generate(group, min(cfg.output_len, 24))
                    e.generate(group, 1)
            e.generate(prefill_prompt, 1)
            warmup_s[e.name] = time.perf_counter() - start

    raw = {e.name: {"decode": {b: {"t_full": [], "t_one": [], "tokens_full": [], "tokens_one": [],
                                   "groups": len(groups[b])} for b in cfg.batch_sizes}, "prefill_s": []}
           for e in engines}
    spec_counts: dict[int, dict[str, Any] | None] = {b: None for b in cfg.batch_sizes}
    outputs: dict[str, dict[int, list[list[int]]]] = {e.name: {} for e in engines}  # of the first repetition
    compiles_before = {e.name: e.num_compiles() for e in welds}
    total = sum(runs[e.name] * (2 * len(cfg.batch_sizes) + 1) for e in engines)
    with Progress(total, "Benchmarking", unit="run", enabled=show) as bar:
        for rep in range(cfg.runs):
            # Interleaved: for each workload, every engine runs it before the next workload starts;
            # the order flips every repetition, so that no engine always runs first.
            order = engines if rep % 2 == 0 else engines[::-1]
            for batch in cfg.batch_sizes:
                for e in order:
                    if rep >= runs[e.name]:
                        continue
                    record = raw[e.name]["decode"][batch]
                    t_one = t_full = 0.0
                    tokens_one = tokens_full = 0
                    produced: list[list[int]] = []
                    for group in groups[batch]:
                        t, outs = timed(lambda: e.generate(group, 1))
                        _check_lengths(e, outs, len(group), 1)
                        t_one, tokens_one = t_one + t, tokens_one + sum(map(len, outs))
                        before = e.spec_counters() if e.name == SPEC_ENGINE else None
                        t, outs = timed(lambda: e.generate(group, cfg.output_len))
                        _check_lengths(e, outs, len(group), cfg.output_len)
                        if before is not None:
                            spec_counts[batch] = spec_add(spec_counts[batch], spec_delta(before, e.spec_counters()))
                        t_full, tokens_full = t_full + t, tokens_full + sum(map(len, outs))
                        produced += outs
                    outputs[e.name].setdefault(batch, produced)
                    for key, value in (("t_one", t_one), ("t_full", t_full), ("tokens_one", tokens_one),
                                       ("tokens_full", tokens_full)):
                        record[key].append(value)
                    bar.update(2)
            for e in order:
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
        results[e.name] = summarize_engine(e, raw[e.name], cfg, input_len, prefill_len, bw)
        results[e.name].update(load_s=load_s[e.name], warmup_s=warmup_s[e.name], runs=runs[e.name])
        if e in welds:
            results[e.name]["compiles_during_timed_runs"] = e.num_compiles() - compiles_before[e.name]
        if e.name == SPEC_ENGINE:
            results[e.name]["spec_stats_end"] = e.spec_counters()  # warm-up included
    if 1 in cfg.batch_sizes:
        ref = outputs["weld"][1][0]
        for name in results:
            tokens = outputs[name][1][0]
            results[name]["greedy_batch1_agrees_with_weld_for"] = next(
                (i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), min(len(ref), len(tokens)))
    workload_info = {"input_len": input_len}
    if texts:
        workload_info.update(prompts_file=cfg.prompts, num_prompts=len(prompts), chat=cfg.chat,
                             prompt_tokens=[len(p) for p in prompts], stop_at_eos=not ignore_eos)
    result = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join(["weld", *sys.argv[1:]]),
        "machine": machine_info(load_start),
        "versions": versions(),
        "config": {**dataclasses.asdict(cfg), "prefill_len": prefill_len, "model_source": str(source.path),
                   "model_name": source.name, "weld_max_model_len": model_len},
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


def speculative_summary(results: dict, spec_counts: dict, outputs: dict, cfg: BenchConfig) -> dict:
    """Per batch size: plain and speculative decode tok/s, their ratio, the acceptance counted over
    the timed full runs (every repetition), and whether the greedy outputs were identical."""
    plain, spec = results["weld"]["decode"], results[SPEC_ENGINE]["decode"]
    per_batch = {}
    for b in cfg.batch_sizes:
        plain_tok_s, spec_tok_s = plain[str(b)]["tok_s"], spec[str(b)]["tok_s"]
        per_batch[str(b)] = {
            "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s,
            "speedup": spec_tok_s / plain_tok_s if plain_tok_s and spec_tok_s else None,
            "acceptance": acceptance(spec_counts[b]) if spec_counts[b] else None,
            "outputs_equal": outputs["weld"][b] == outputs[SPEC_ENGINE][b],
        }
    return {"config": cfg.spec, "per_batch": per_batch}


def summarize_engine(engine, raw: dict, cfg: BenchConfig, input_len: int, prefill_len: int, bw_gb_s: float) -> dict:
    decode = {}
    for batch, times in raw["decode"].items():
        if not times["t_full"]:
            continue
        per_run = [(n_full - n_one) / (f - o) if f > o else None
                   for f, o, n_full, n_one in zip(times["t_full"], times["t_one"], times["tokens_full"],
                                                  times["tokens_one"])]
        valid = [r for r in per_run if r is not None]
        tok_s = statistics.median(valid) if valid else None
        step_bytes = floor_bytes(engine.weight_bytes, engine.kv_bytes_per_token, batch, input_len, cfg.output_len)
        floor_tok_s = batch * bw_gb_s * 1e9 / step_bytes["total"]
        decode[str(batch)] = {
            "t_full_s": times["t_full"], "t_one_s": times["t_one"], "tokens_full": times["tokens_full"],
            "tokens_one": times["tokens_one"], "groups": times["groups"], "tok_s_per_run": per_run, "tok_s": tok_s,
            "bytes_per_step": step_bytes, "floor_tok_s": floor_tok_s,
            "floor_fraction": tok_s / floor_tok_s if tok_s else None,
        }
    prefill_s = statistics.median(raw["prefill_s"]) if raw["prefill_s"] else None
    first = raw["decode"].get(1)
    # Batch 1 runs one group per prompt: the mean 1-token time of a prompt.
    ttft = statistics.median(first["t_one"]) / first["groups"] if first and first["t_one"] else None
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
    """weld / other, as speeds (above 1: weld is faster); TTFT as other's time / weld's. The
    speculative engine is compared in `speculative_summary`, not here."""
    weld = results["weld"]
    out = {}
    for name, other in results.items():
        if name in ("weld", SPEC_ENGINE):
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
    others = [n for n in names if n not in ("weld", SPEC_ENGINE)]
    cfg = result["config"]
    bw = result["bandwidth_start"]
    work = result["workload"]
    if cfg["prompts"]:
        what = (f"{work['num_prompts']} prompts of {cfg['prompts']} ({'chat template, ' if cfg['chat'] else ''}"
                f"mean {work['input_len']} tokens), up to {cfg['output_len']} new"
                + (" (stopping at EOS)" if work["stop_at_eos"] else ""))
    else:
        what = f"prompt {cfg['input_len']} tokens, {cfg['output_len']} new"
    lines = [
        f"weld bench: {cfg['model_name']}, {what}, greedy; "
        f"median of {cfg['runs']} run{'s' if cfg['runs'] > 1 else ''}" + (f" ({cfg['vs_runs']} for {', '.join(others)})"
                                            if others and cfg['vs_runs'] != cfg['runs'] else ""),
        f"memory bandwidth {bw['used_gb_s']:.1f} GB/s (numpy on {bw['array_gb']:.1f} GB: copy {bw['copy_gb_s']:.1f} "
        f"r+w, sum {bw['sum_gb_s']:.1f}); at the end {result['bandwidth_end']['used_gb_s']:.1f} GB/s",
    ]
    label_width = max(18, *(len(engines[n]["label"]) for n in names))
    for n in names:
        e = engines[n]
        extra = f", {e['torch_threads']} torch threads" if "torch_threads" in e else (
            f", {e['threads']} threads" if "threads" in e else "")
        lines.append(f"  {e['label']:<{label_width}} {e['batching']}{extra}; KV {e['kv_dtype']}; "
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
    if "speculative" in result:
        lines += ["", *format_speculative(result["speculative"])]
    compiled = {engines[n]["label"]: engines[n]["compiles_during_timed_runs"] for n in names
                if engines[n].get("compiles_during_timed_runs")}
    if compiled:
        lines.append(f"warning: programs compiled during the timed runs ({compiled}): those runs include compile time")
    lines.append("")
    lines.append("decode tok/s: aggregate over the batch, B * (out - 1) / (t(out tokens) - t(1 token)) "
                 "(text prompts: the new tokens actually produced after the first, over the same time); "
                 "% of floor: of B * bandwidth / bytes read per step (all weights in the engine's format + the "
                 "mean KV in context); ratios above 1: weld is faster (TTFT: other's time / weld's).")
    load = result["machine"]
    lines.append(f"load average (1 min) {load['loadavg_start'][0]:.2f} at start, {load['loadavg_end'][0]:.2f} at end, "
                 f"on {load['cpu_count']} cores: above ~0.5, other work shared the machine.")
    return "\n".join(lines)


def format_speculative(spec: dict) -> list[str]:
    """The speculative section: speedup over plain decoding and acceptance, per batch size."""
    config = spec["config"]
    method = config["method"] + (f" {config['prompt_lookup_min']}..{config['prompt_lookup_max']}-grams"
                                 if config["method"] == "ngram" else f" {config.get('model')}")
    lines = [f"speculative decoding: {method}, k={config['num_speculative_tokens']}, vs the same engine without it",
             f"{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'mean accepted len':>19}"
             f"{'accepted':>10}   per position (accepted / drafted in slot j)"]
    for b, row in spec["per_batch"].items():
        acc = row["acceptance"] or {}
        positions = " ".join(_fmt(r and 100 * r, ".0f", "%") for r in acc.get("per_position_rate", []))
        rate = acc.get("acceptance_rate")
        lines.append(f"{b:>6}{_fmt(row['plain_tok_s'], '.1f'):>13}{_fmt(row['spec_tok_s'], '.1f'):>12}"
                     f"{_fmt(row['speedup'], '.2f', 'x'):>9}{_fmt(acc.get('mean_acceptance_length'), '.2f'):>19}"
                     f"{_fmt(rate and 100 * rate, '.0f', '%'):>10}   {positions or '-'}")
    differ = [b for b, row in spec["per_batch"].items() if not row["outputs_equal"]]
    if differ:
        lines.append(f"note: greedy outputs differ from plain decoding at batch {', '.join(differ)} "
                     "(float rounding in the batched verification can flip a near tie)")
    lines.append("mean accepted len: tokens per verification step, 1 + accepted / steps that sent drafts; "
                 "accepted: of the drafted tokens.")
    return lines


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
