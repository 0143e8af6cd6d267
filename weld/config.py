"""Engine settings, defined once: frozen dataclasses, their checks, and the command-line flags.

`EngineConfig` is what `LLM`, `AsyncLLM`, `weld serve`, `weld generate`, `weld chat` and `weld
bench` take. Its keyword form follows vLLM (`LLM(model, max_model_len=..., max_num_seqs=...,
speculative_config={...})`): `EngineConfig.create(**kwargs)` files each keyword into its
group and checks every value before anything slow happens, with a one-line error naming the
setting and the value. `add_engine_arguments` defines the flags (vLLM's names where vLLM has
the setting) and `EngineConfig.from_args` reads them back, so no entry point spells a setting
out on its own. Plain Python: no jax here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from weld.utils.errors import InvalidInputError

BACKENDS = ("xla", "megakernel")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# `weld train-draft --features`: run the target over every answer before training (its features
# kept on disk), or inside each training step
TRAIN_FEATURES = ("stored", "online")
# --kv-cache-dtype (vLLM's flag): "auto" stores K/V in the model's dtype (float16 on the CPU under --dtype auto).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV pool's memory when no size is given: at most this, and no more than max_num_seqs
# sequences of max_model_len tokens need.
DEFAULT_KV_CACHE_GB = 1.0
# --quantization (vLLM's flag): None keeps a GGUF's quantized blocks (quant.GGUF_KEPT) quantized and loads
# anything else as stored; "none" dequantizes every tensor to dtype; "int8" / "int4" / "int4_g128"
# quantize the projections and the LM head once at load (a scale per 32 inputs, int4_g128 per 128:
# `weld.models.common.quant`, for the CPU kernels); "int8_channel" per output channel (for XLA on
# GPU / TPU and the megakernel); "int8_channel_int4_experts" the seeds' MoE mix: that, with the
# expert stacks int4 per group of 128 inputs.
QUANTIZATIONS = ("none", "int8", "int4", "int4_g128", "int8_channel", "int8_channel_int4_experts")
ROW_QUANTIZATIONS = ("int8_channel", "int8_channel_int4_experts")  # laid out as rows: XLA on GPU / TPU, the megakernel
SPEC_METHODS = ("ngram", "draft_model", "dspark")
# Bounds on sizes a user sets, checked before anything is allocated from them.
MAX_NUM_SEQS = 4096
MAX_BATCHED_TOKENS = 1 << 20
MAX_PAGE_SIZE = 1024
MAX_STEPS_PER_CALL = 256
MAX_NUM_PAGES = 1 << 24
MAX_DEVICES = 1 << 16


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidInputError(message)


def _int_in(name: str, value: Any, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    _check(ok, f"{name} must be an integer {bounds}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: page_size tokens per page (vLLM's block_size); num_pages pages, or as
    many as kv_cache_memory_gb GiB hold (counted from the model's cache spec; None: what
    max_num_seqs sequences of max_model_len tokens take, at most DEFAULT_KV_CACHE_GB);
    kv_cache_dtype the pools' element type ("auto": the model's dtype, float16 where that is "auto"
    on the CPU, `llm.resolve_kv_dtype`). Both sizes are the whole
    cache's: data-parallel ranks share them evenly (each still holds one max_model_len sequence)."""

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        _int_in("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        if self.num_pages is not None:
            _int_in("num_pages", self.num_pages, 1, MAX_NUM_PAGES)
        _check(self.kv_cache_memory_gb is None or (isinstance(self.kv_cache_memory_gb, (int, float))
                                                    and not isinstance(self.kv_cache_memory_gb, bool)
                                                    and 0 < self.kv_cache_memory_gb <= 1 << 14),
               f"kv_cache_memory_gb must be > 0 (and at most 16384), got {self.kv_cache_memory_gb!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Batching: at most max_num_seqs sequences and max_num_batched_tokens prompt tokens per step;
    max_model_len caps prompt + output (None: the model's context); steps_per_call decode steps
    run in one device call; a streamed request's tokens go out every stream_interval tokens, from
    inside the call (vLLM's name; 1: each as it is sampled)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    steps_per_call: int = 8
    stream_interval: int = 1

    def __post_init__(self):
        _int_in("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS)
        _int_in("max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_BATCHED_TOKENS)
        if self.max_model_len is not None:
            _int_in("max_model_len", self.max_model_len, 1)
        _int_in("steps_per_call", self.steps_per_call, 1, MAX_STEPS_PER_CALL)
        _int_in("stream_interval", self.stream_interval, 1, MAX_STEPS_PER_CALL)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices (vLLM's names): tensor_parallel_size devices split
    every layer (attention heads, MLP columns, the vocabulary), data_parallel_size groups of them
    each serve their own sequences (their batch rows and their pages of the caches: data-parallel
    attention); enable_expert_parallel puts the routed experts over all tp x dp
    devices instead of splitting each expert, and expert_tensor_parallel_size (with it) splits
    each expert's FFN over that many of the tp devices (the seeds' TP4 x EP8 on 32 devices:
    tp 32, expert tp 4). `weld.models.common.sharding` holds the rules. nnodes > 1 spreads the
    devices over hosts (`jax.distributed`): rank 0 (node_rank) schedules and serves, the others
    run headless, every rank connects to master_addr:master_port (the JAX coordinator; the
    step plans go over master_port + 1)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_tensor_parallel_size: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self):
        _int_in("tensor_parallel_size", self.tensor_parallel_size, 1, MAX_DEVICES)
        _int_in("data_parallel_size", self.data_parallel_size, 1, MAX_DEVICES)
        _check(self.world_size <= MAX_DEVICES,
               f"tensor_parallel_size x data_parallel_size must be at most {MAX_DEVICES}, got {self.world_size}")
        _check(isinstance(self.enable_expert_parallel, bool),
               f"enable_expert_parallel must be true or false, got {self.enable_expert_parallel!r}")
        if self.expert_tensor_parallel_size is not None:
            _check(self.enable_expert_parallel, "expert_tensor_parallel_size needs enable_expert_parallel")
            _int_in("expert_tensor_parallel_size", self.expert_tensor_parallel_size, 1, self.tensor_parallel_size)
            _check(self.tensor_parallel_size % self.expert_tensor_parallel_size == 0,
                   f"expert_tensor_parallel_size ({self.expert_tensor_parallel_size}) must divide "
                   f"tensor_parallel_size ({self.tensor_parallel_size})")
        _int_in("nnodes", self.nnodes, 1, MAX_DEVICES)
        _int_in("node_rank", self.node_rank, 0, self.nnodes - 1)
        _int_in("master_port", self.master_port, 1, 65534)
        _check(isinstance(self.master_addr, str) and bool(self.master_addr),
               f"master_addr must be a host name or address, got {self.master_addr!r}")

    @property
    def world_size(self) -> int:
        """Devices the model runs on (over every host)."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def sharded(self) -> bool:
        return self.world_size > 1 or self.nnodes > 1


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding; method None = off. `parse` takes vLLM's speculative_config dict."""

    method: str | None = None  # "ngram" | "draft_model" | "dspark"
    k: int | None = 0  # drafts per step (DSpark: None until the drafter's block size is known)
    model: str | None = None  # the draft model, or the DSpark drafter's directory
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    confidence_threshold: float | None = None  # DSpark: None = the drafter's own default
    rounds_per_call: int | None = None  # propose -> verify rounds per device call (None: steps_per_call)
    # weld's own key: choose each call's drafts per round (up to k, or none) by measured throughput
    adaptive: bool = True

    KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
            "confidence_threshold", "rounds_per_call", "adaptive")

    @classmethod
    def parse(cls, config: dict[str, Any] | None) -> "SpeculativeConfig":
        if not config:
            return cls()
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise InvalidInputError(f"speculative_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(cls.KEYS))
        if unknown:
            raise InvalidInputError(f"unknown speculative_config keys {unknown}; known: {list(cls.KEYS)}")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method == "draft":
            method = "draft_model"
        if method not in SPEC_METHODS:
            raise InvalidInputError(f"speculative method must be one of {SPEC_METHODS}, got {method!r}")
        k = config.get("num_speculative_tokens", None if method == "dspark" else 4)
        if k is not None:
            _int_in("num_speculative_tokens", k, 1, 16)
        lo, hi = config.get("prompt_lookup_min", 1), config.get("prompt_lookup_max", 3)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise InvalidInputError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {lo!r} and {hi!r}")
        if method == "draft_model" and not config.get("model"):
            raise InvalidInputError(f"speculative method {method!r} needs a draft model: give 'model'")
        threshold = config.get("confidence_threshold")
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0 <= threshold <= 1):
            raise InvalidInputError(f"confidence_threshold must lie in [0, 1], got {threshold!r}")
        rounds = config.get("rounds_per_call")
        if rounds is not None:
            _int_in("rounds_per_call", rounds, 1, 64)
        adaptive = config.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise InvalidInputError(f"speculative_config 'adaptive' must be true or false, got {adaptive!r}")
        return cls(method, k, config.get("model"), lo, hi, threshold, rounds, adaptive)

    def rounds(self, steps_per_call: int) -> int:
        """Rounds per device call (every method drafts inside the device loop): as given, or
        steps_per_call, so that a call runs as many target forwards as a plain decode call."""
        if self.method is None:
            return 1
        return self.rounds_per_call or max(1, steps_per_call)

    def widths(self) -> tuple[int, ...]:
        """The drafts per round a call may verify (0: a plain decode call): k alone, or with
        `adaptive` the candidates `policy.WidthPolicy` chooses among. () when not speculating."""
        if self.method is None:
            return ()
        if not self.adaptive:
            return (self.k,)
        # a plain decode, one draft, three, and k: each width is a program of its own to compile
        return tuple(sorted({0, 1, min(3, self.k), self.k}))

    def tokens_per_call(self, steps_per_call: int) -> int:
        """The most tokens a sequence may produce in one decode call (the slots it is given)."""
        if self.method is None:
            return steps_per_call
        return self.rounds(steps_per_call) * ((self.k or 1) + 1)

    def as_dict(self) -> dict[str, Any] | None:
        """vLLM's speculative_config dict of these settings (None when off)."""
        if self.method is None:
            return None
        out = {"method": self.method, "num_speculative_tokens": self.k, "model": self.model,
               "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max,
               "confidence_threshold": self.confidence_threshold, "rounds_per_call": self.rounds_per_call,
               "adaptive": None if self.adaptive else False}
        return {key: value for key, value in out.items() if value is not None}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. model: a GGUF file, a HF directory, a hub id, or None
    for the bundled default; dtype of weights and KV cache ("auto": float32 on CPU, bfloat16
    elsewhere); backend of the decode program ("xla" everywhere, "megakernel" the Pallas TPU
    kernel, interpret mode off a TPU); quantization of the weights (`QUANTIZATIONS`; None: as the
    checkpoint stores them, a GGUF's blocks kept)."""

    model: str | None = None
    dtype: str = "auto"
    backend: str = "xla"
    quantization: str | None = None
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self):
        _check(self.dtype in DTYPES or not isinstance(self.dtype, str),
               f"unknown dtype {self.dtype!r}; use {', '.join(DTYPES)}")
        _check(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS,
               f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _check(self.backend != "megakernel" or self.quantization in (None, "none", *ROW_QUANTIZATIONS),
               f"the megakernel backend takes float weights, int8 per output channel (quantization "
               f"'int8_channel') or with int4 experts ('int8_channel_int4_experts'), not {self.quantization!r}")
        if self.parallel.sharded:
            par = self.parallel
            _check(self.backend == "xla" or par.nnodes == 1,
                   "the megakernel backend runs on one host (nnodes 1): use backend 'xla' over several hosts")
            _check(self.quantization in (None, "none"),
                   f"quantization {self.quantization!r} runs on one device (the native CPU kernels); over a mesh "
                   "weights load as float (a GGUF's blocks are dequantized)")

    @property
    def load_quantization(self) -> str | None:
        """`weld.weights.load_model`'s quantization: this config's, except that the megakernel takes
        no GGUF blocks, nor does a mesh (None: "none")."""
        if self.quantization is None and (self.backend == "megakernel" or self.parallel.sharded):
            return "none"
        return self.quantization

    @classmethod
    def create(cls, model: str | None = None, dtype: Any = "auto", *, backend: str = "xla",
               quantization: str | None = None,
               speculative_config: dict[str, Any] | SpeculativeConfig | None = None, **kwargs: Any) -> "EngineConfig":
        """The config of vLLM-style keyword arguments: CacheConfig's and SchedulerConfig's fields
        by name, speculative_config as vLLM's dict. Unknown keywords are an error."""
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
        values: dict[str, dict[str, Any]] = {name: {} for name in groups}
        for key, value in kwargs.items():
            group = next((g for g, c in groups.items() if key in {f.name for f in dataclasses.fields(c)}), None)
            if group is None:
                known = sorted(f.name for c in groups.values() for f in dataclasses.fields(c))
                raise InvalidInputError(f"unknown engine setting {key!r}; known: {', '.join(known)}, backend, "
                                        "quantization, speculative_config")
            values[group][key] = value
        return cls(model=None if model is None else str(model), dtype=dtype, backend=backend,
                   quantization=quantization,
                   cache=CacheConfig(**values["cache"]), scheduler=SchedulerConfig(**values["scheduler"]),
                   speculative=SpeculativeConfig.parse(speculative_config),
                   parallel=ParallelConfig(**values["parallel"]))

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with top-level fields or group fields (by their own names) changed."""
        top = {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(self)}}
        rest = {k: v for k, v in changes.items() if k not in top}
        cache = {k: v for k, v in rest.items() if k in {f.name for f in dataclasses.fields(CacheConfig)}}
        sched = {k: v for k, v in rest.items() if k in {f.name for f in dataclasses.fields(SchedulerConfig)}}
        par = {k: v for k, v in rest.items() if k in {f.name for f in dataclasses.fields(ParallelConfig)}}
        unknown = set(rest) - set(cache) - set(sched) - set(par)
        if unknown:
            raise InvalidInputError(f"unknown engine settings {sorted(unknown)}")
        return dataclasses.replace(self, **top, cache=dataclasses.replace(top.get("cache", self.cache), **cache),
                                   scheduler=dataclasses.replace(top.get("scheduler", self.scheduler), **sched),
                                   parallel=dataclasses.replace(top.get("parallel", self.parallel), **par))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config of the flags `add_engine_arguments` defined."""
        return cls.create(model=args.model, dtype=args.dtype, backend=args.backend, quantization=args.quantization,
                          speculative_config=speculative_config_from_args(args),
                          max_model_len=args.max_model_len, kv_cache_memory_gb=args.kv_cache_memory_gb,
                          page_size=args.block_size, num_pages=args.num_pages, kv_cache_dtype=args.kv_cache_dtype,
                          enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, steps_per_call=args.steps_per_call,
                          stream_interval=args.stream_interval, **parallel_settings_from_args(args))


def parallel_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """`ParallelConfig`'s keywords from the flags `add_parallel_arguments` (and, where a command
    defines them, `add_multihost_arguments`) defined."""
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


# ----- command-line flags -----

SPEC_FLAGS = {"ngram": "ngram", "draft": "draft_model", "dspark": "dspark"}  # --spec value -> method
DEFAULT_SPEC_K = 4
DEFAULT_NGRAM_MIN, DEFAULT_NGRAM_MAX = 1, 3  # the engine's prompt_lookup_min / _max defaults


def add_engine_arguments(p: argparse.ArgumentParser, *,
                         model_default_help: str = "bundled SmolLM2-135M-Instruct") -> None:
    """The engine's flags: model, cache, scheduler, backend, speculative decoding."""
    defaults, cache, sched = EngineConfig(), CacheConfig(), SchedulerConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="PATH_OR_ID",
                   help=f"GGUF file, HF directory, `weld convert` directory or hub id (default: {model_default_help})")
    g.add_argument("--dtype", default=defaults.dtype, choices=list(DTYPES),
                   help="weight dtype, and the KV cache's unless --kv-cache-dtype says otherwise; auto is "
                        "float32 on CPU (with a float16 cache), bfloat16 on GPU/TPU (default: auto)")
    add_quantization_argument(g)
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length (default: the model's)")
    g.add_argument("--backend", default=defaults.backend, choices=list(BACKENDS),
                   help="decode program: xla runs everywhere; megakernel is the Pallas TPU kernel "
                        "(interpret mode off a TPU, for correctness only) (default: xla)")
    g = p.add_argument_group("KV cache and batching")
    g.add_argument("--kv-cache-memory-gb", type=float, default=cache.kv_cache_memory_gb, metavar="GB",
                   help="memory for the paged KV cache, shared by the data-parallel ranks (default: what "
                        f"--max-num-seqs sequences of --max-model-len tokens take, at most {DEFAULT_KV_CACHE_GB:g})")
    g.add_argument("--kv-cache-dtype", default=cache.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type (default: auto, the --dtype given; with --dtype auto on the "
                        "CPU float16, half of a float32 cache, as llama.cpp keeps it)")
    g.add_argument("--block-size", type=int, default=cache.page_size, metavar="N",
                   help=f"tokens per KV page (default: {cache.page_size})")
    g.add_argument("--num-pages", type=int, default=None, metavar="N",
                   help="exactly this many KV pages, shared by the data-parallel ranks (default: as many as "
                        "--kv-cache-memory-gb holds)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=cache.enable_prefix_caching, help="reuse the KV pages of shared prompt prefixes "
                                                             "(default: on)")
    g.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs, metavar="N",
                   help=f"most sequences per batch (default: {sched.max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens, metavar="N",
                   help=f"prompt tokens per prefill step (default: {sched.max_num_batched_tokens})")
    g.add_argument("--steps-per-call", type=int, default=sched.steps_per_call, metavar="K",
                   help=f"decode steps per device call (default: {sched.steps_per_call})")
    g.add_argument("--stream-interval", type=int, default=sched.stream_interval, metavar="N",
                   help="a streamed request's tokens go out every N tokens, from inside the device call "
                        f"(default: {sched.stream_interval}: each as it is sampled; steps-per-call or more: after each call)")
    add_speculative_arguments(p)
    add_parallel_arguments(p)


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size / -tp, --data-parallel-size / -dp, --enable-expert-parallel
    (vLLM's names) and --expert-tensor-parallel-size."""
    g = p.add_argument_group("parallelism (devices of every host: `weld.models.common.sharding`)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="devices that split every layer: attention heads, MLP columns, the vocabulary (default: 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                   help="groups of --tensor-parallel-size devices, each serving its own sequences with its own "
                        "share of the KV cache (data-parallel attention; default: 1)")
    g.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="put whole routed experts on the tp x dp devices instead of splitting every expert "
                        "(MoE models)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="with --enable-expert-parallel: split each expert's FFN over N of the tp devices "
                        "(default: 1)")


def add_multihost_arguments(p: argparse.ArgumentParser) -> None:
    """--nnodes, --node-rank, --master-addr, --master-port (vLLM's names) for a model spread over hosts."""
    g = p.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--nnodes", type=int, default=None, metavar="N", help="hosts the model spans (default: 1)")
    g.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this host's rank; rank 0 schedules and serves HTTP, the others run --headless (default: 0)")
    g.add_argument("--master-addr", default=None, metavar="HOST",
                   help="rank 0's address, where every rank connects (default: 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="the JAX coordinator's port on rank 0; the step plans use PORT + 1 (default: 29500)")


def add_quantization_argument(g) -> None:
    """--quantization / -q (vLLM's name), for the engine's flags and `weld bench`'s."""
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                   help="weight quantization: int8 or int4 quantize the projections and LM head at load "
                        "(blocks of 32, for the CPU kernels; int4_g128: int4 with a scale and min per 128 "
                        "inputs; int8_channel: per output channel, for GPU, TPU "
                        "and the megakernel; int8_channel_int4_experts: that, with MoE experts int4 per 128 "
                        "inputs); none dequantizes a GGUF (default: as stored, a GGUF's Q8_0/Q4_*/Q5_*/Q2_K..Q6_K "
                        "blocks kept)")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """--speculative-config JSON (vLLM's), or weld's short form --spec, --spec-k, --draft,
    --spec-ngram-min, --spec-ngram-max (read by `speculative_config_from_args`)."""
    g = p.add_argument_group("speculative decoding (greedy outputs stay the same; sampled ones keep their "
                             "distribution)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative_config as JSON, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (or use --spec)")
    g.add_argument("--spec", default=None, choices=list(SPEC_FLAGS),
                   help="draft tokens cheaply and verify them in one step of the model: ngram (look up the "
                        "context's last n-gram earlier in the context), draft (a smaller model with the same "
                        "tokenizer: --draft), dspark (a DSpark drafter from weld train-draft: --draft; the bundled "
                        "model has one built in) (default: off)")
    g.add_argument("--spec-k", type=int, default=None, metavar="N",
                   help=f"most drafted tokens per step (default: {DEFAULT_SPEC_K}; dspark: the drafter's block)")
    g.add_argument("--draft", default=None, metavar="PATH",
                   help="--spec draft: the draft model (GGUF file or HF directory); --spec dspark: the drafter "
                        "directory")
    g.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each call's drafts per round (up to --spec-k, or none) by the throughput measured "
                        "so far; outputs are the same either way (default: on)")
    g.add_argument("--spec-ngram-min", type=int, default=None, metavar="N",
                   help=f"--spec ngram: shortest n-gram looked up (default: {DEFAULT_NGRAM_MIN})")
    g.add_argument("--spec-ngram-max", type=int, default=None, metavar="N",
                   help=f"--spec ngram: longest n-gram looked up, tried first (default: {DEFAULT_NGRAM_MAX})")


def speculative_config_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The speculative flags as `LLM(speculative_config=...)` (vLLM's keys), None without them.

    Combinations that make no sense are one-line errors; value ranges are checked by
    `SpeculativeConfig.parse` (before anything loads)."""
    ngram_flags = [flag for flag, value in (("--spec-ngram-min", args.spec_ngram_min),
                                            ("--spec-ngram-max", args.spec_ngram_max)) if value is not None]
    short = [flag for flag, value in (("--spec", args.spec), ("--spec-k", args.spec_k), ("--draft", args.draft),
                                      ("--spec-adaptive", getattr(args, "spec_adaptive", None)))
             if value is not None] + ngram_flags
    if getattr(args, "speculative_config", None) is not None:
        if short:
            raise InvalidInputError(f"--speculative-config and {short[0]} both set speculative decoding: use one")
        try:
            config = json.loads(args.speculative_config)
        except ValueError as err:
            raise InvalidInputError(f"--speculative-config is not valid JSON: {err}") from None
        if not isinstance(config, dict):
            raise InvalidInputError("--speculative-config must be a JSON object")
        SpeculativeConfig.parse(config)
        return config
    if args.spec is None:
        if short:
            raise InvalidInputError(f"{short[0]} needs --spec ngram, draft or dspark")
        return None
    k = (None if args.spec == "dspark" else DEFAULT_SPEC_K) if args.spec_k is None else args.spec_k
    if k is not None and k < 1:
        raise InvalidInputError(f"--spec-k must be >= 1, got {k}")
    config: dict[str, Any] = {"method": SPEC_FLAGS[args.spec]}
    if k is not None:  # dspark: the drafter's block size unless given
        config["num_speculative_tokens"] = k
    if getattr(args, "spec_adaptive", None) is not None:
        config["adaptive"] = args.spec_adaptive
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
        if args.spec == "dspark":
            return config  # the drafter that ships for the model, if one does
        raise InvalidInputError("--spec draft needs --draft PATH: a draft model (GGUF file or HF directory)")
    return config | {"model": args.draft}
