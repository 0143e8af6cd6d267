"""The `weld bench` flags and their checks: `add_arguments` defines them, `config_from_args` reads
them into a frozen `BenchConfig`, failing with a one-line error before anything slow is loaded.

Only the bench-specific flags are defined here; the speculative decoding flags are weld's own
(`weld.config.add_speculative_arguments`), the same on every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
from typing import Any

from weld.config import (DTYPES, KV_CACHE_DTYPES, SpeculativeConfig, add_quantization_argument,
                         add_speculative_arguments, speculative_config_from_args)
from weld.utils.errors import InvalidInputError, WeldError

ENGINES = ("hf", "llamacpp")  # what --vs accepts; weld always runs
DEFAULT_BATCH_SIZES = "1,4,16,64"
DEFAULT_SPEC_BATCH_SIZES = "1,4"  # with --spec or --prompts: speculation pays off at small batches
DEFAULT_PREFILL_LEN = 1024
LLAMACPP_HINT = "pip install llama-cpp-python (or pip install 'weld[bench]')"
HF_HINT = "pip install torch transformers accelerate (or pip install 'weld[test]')"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `weld bench` flags (the CLI stays thin: it only calls this and `main`)."""
    p.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help="GGUF file, HF directory or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="weld's weight dtype, and its KV cache's unless --kv-cache-dtype; auto is float32 "
                        "on CPU, with a float16 cache (default: auto)")
    add_quantization_argument(p)
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="weld's KV cache element type (default: auto: the --dtype given; float16 on the "
                        "CPU with --dtype auto)")
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
                   help="JSON result file, its chart goes next to it as PATH with .svg "
                        "(default: benchmarks/results/bench_<date>_<time>.json)")
    p.add_argument("--chart", nargs="+", default=None, metavar="RESULT.json",
                   help="only draw the charts (RESULT.svg) of existing result files, running nothing")
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
    """The checked flags of one `weld bench` run (written whole into the JSON's "config")."""

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
    quantization: str | None = None  # weld's --quantization
    kv_cache_dtype: str = "auto"  # weld's --kv-cache-dtype

    @property
    def weld_options(self) -> dict[str, Any]:
        """The weld engine settings the bench passes through (`EngineConfig.create`'s keywords)."""
        return {"quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype}


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


def _speculative(args: argparse.Namespace) -> dict[str, Any] | None:
    """The speculative engine's speculative_config (None: no second engine), checked by the
    engine's own `SpeculativeConfig.parse`. The method, k and (n-gram) lookup sizes are always
    present, filled in from the engine's defaults when --speculative-config left them out: the
    report names them."""
    spec = speculative_config_from_args(args)
    if spec is None:
        return None
    parsed = SpeculativeConfig.parse(spec)
    filled: dict[str, Any] = {"method": parsed.method, "num_speculative_tokens": parsed.k}
    if parsed.method == "ngram":
        filled |= {"prompt_lookup_min": parsed.prompt_lookup_min, "prompt_lookup_max": parsed.prompt_lookup_max}
    return spec | filled


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
    spec = _speculative(args)
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
                       prompts=args.prompts, chat=args.chat, ignore_eos=args.ignore_eos, spec=spec,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
