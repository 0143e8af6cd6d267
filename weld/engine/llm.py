"""`LLM`: offline generation in the shape vLLM users already write.

    from weld import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Any, Callable, Iterable, Sequence as Seq

import jax
import jax.numpy as jnp

from weld.config import DEFAULT_KV_CACHE_GB, EngineConfig, SpeculativeConfig
from weld.engine import distributed
from weld.engine.block_manager import SNAPSHOT_INTERVAL, BlockManager, DataParallelBlockManager
from weld.engine.core import EngineCore
from weld.engine.outputs import RequestOutput, TextCursor
from weld.engine.runner import ModelRunner
from weld.engine.sampling_params import SamplingParams
from weld.engine.scheduler import Scheduler
from weld.kernels import cpu as cpu_kernels
from weld.models.common import sharding
from weld.models.family import WeightTarget, check_config
from weld.tokenizer import Tokenizer
from weld.utils.errors import InvalidInputError
from weld.utils.memory import release_free_memory
from weld.utils.progress import Progress, status
from weld.weights import LoadedModel, load_model, resolve_model

PromptType = str | dict[str, Any]

# A model with linear-attention layers keeps prefix-cache snapshots of its recurrent state in
# slots of their own (`BlockManager`): this share of the KV memory, and at least this many.
SNAPSHOT_SHARE = 0.1
MIN_SNAPSHOT_SLOTS = 4


_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
           "float16": jnp.float16, "f16": jnp.float16, "half": jnp.float16}


def resolve_dtype(dtype: Any) -> Any:
    """'auto' is float32 on CPU (XLA:CPU computes bf16 slower than f32) and bfloat16 elsewhere."""
    if dtype is None or dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InvalidInputError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type


def resolve_kv_dtype(kv_cache_dtype: str, dtype: Any) -> Any:
    """The KV pools' element type for the model dtype asked for (`dtype`, before `resolve_dtype`).
    'auto' is that dtype, except where weld chose it too ('auto' on the CPU, float32 for speed):
    then float16, as llama.cpp keeps its cache, half the pool; the native attention kernel widens
    f16 rows as it reads them at no cost measured (`benchmarks/results/kv_dtype_2026-12-07.json`).
    An explicit --dtype float32 keeps a float32 cache, as vLLM's 'auto' would. Recurrent states
    stay float32 whatever this says (`cache.Recurrent`)."""
    if kv_cache_dtype != "auto":
        return jnp.dtype(kv_cache_dtype).type
    model_dtype = resolve_dtype(dtype)
    if (dtype is None or dtype == "auto") and model_dtype == jnp.float32:
        return jnp.float16
    return model_dtype


def enable_compilation_cache() -> None:
    """Keeps compiled programs on disk (~/.cache/weld/xla, or $WELD_CACHE_DIR; "0" disables), so
    only the first run on a machine pays for compiling a model's programs."""
    import os

    directory = os.environ.get("WELD_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "weld", "xla"))
    if directory in ("", "0") or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _host_proposer(spec: SpeculativeConfig):
    """The host-side drafter of a speculative config (n-gram lookup, for grammar-constrained
    rows, whatever the method), or None when not speculating."""
    if spec.method is None:
        return None
    from weld.engine.spec.ngram import NgramProposer

    return NgramProposer(k=spec.k, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)


logger = logging.getLogger("weld.engine")


def _nbytes(tree: Any) -> int:
    """Bytes of every array in a pytree."""
    return sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree))


def _keeps_state(drafter) -> bool:
    """Whether a device drafter keeps per-token state on the target's pages."""
    return drafter is not None and drafter.cache_spec() is not None


def load_tokenizer(loaded: LoadedModel) -> Tokenizer:
    if loaded.gguf_metadata is not None:
        return Tokenizer.from_gguf_metadata(loaded.gguf_metadata)
    return Tokenizer.from_hf_dir(loaded.source.path)


class LLM:
    """A model plus an engine, for offline batched generation.

    model: a GGUF file, a HF directory (config.json + safetensors), a hub id, or None for the
    bundled default. The other settings are vLLM's keyword arguments (`weld.config.EngineConfig.create`:
    max_model_len, max_num_seqs, max_num_batched_tokens, page_size, num_pages, kv_cache_memory_gb,
    enable_prefix_caching, steps_per_call, backend, speculative_config), or one
    `engine_config=EngineConfig(...)`. Decoding runs `steps_per_call` steps per device call (the
    welded decode loop); backend "megakernel" runs those steps as the TPU megakernel (Pallas
    interpret mode off a TPU: slow, for correctness) instead of "xla".
    `speculative_config` turns on speculative decoding (vLLM's keys): {"method": "ngram" |
    "draft_model" | "dspark", "num_speculative_tokens": k, "prompt_lookup_min"/"prompt_lookup_max":
    n-gram sizes, "model": the draft model (same tokenizer) or the DSpark drafter's directory
    (`weld train-draft`), "confidence_threshold": DSpark's survival threshold for sending
    drafts}. Outputs are the same as without it (greedy, or sampled with a seed: token for
    token; unseeded: in distribution; docs/speculative.md).
    """

    def __init__(self, model: str | None = None, dtype: Any = "auto", *, engine_config: EngineConfig | None = None,
                 progress: bool | None = None, **kwargs: Any):
        if engine_config is None:
            engine_config = EngineConfig.create(model, dtype, **kwargs)  # bad settings fail before slow work
        elif model is not None or kwargs or dtype != "auto":
            raise InvalidInputError("give either engine_config or the model and keyword settings, not both")
        self.config = config = engine_config
        # A multi-host run meets its other ranks and starts the JAX runtime over every host
        # first: nothing may touch a JAX backend before (`weld.engine.distributed`).
        self.channel = distributed.initialize(config.parallel) if config.parallel.nnodes > 1 else None
        enable_compilation_cache()
        self.dtype = resolve_dtype(config.dtype)
        self.kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, config.dtype)
        # Over a mesh, the mesh is made from the checkpoint's config before any weight is read, so
        # that every process reads only the slices of the weights its devices hold.
        started = time.perf_counter()
        self.model = load_model(resolve_model(config.model), dtype=self.dtype, progress=progress,
                                quantization=config.load_quantization,
                                mesh_for=lambda family, cfg: self._mesh(family, config, cfg))
        source = self.model.source
        logger.info("loaded %s (%s %s, %s) in %.1f s: %.2f GB read", source.name, self.model.family.__name__.rsplit(".")[-1],
                    source.kind, source.path, time.perf_counter() - started, self.model.bytes_read / 1e9)
        self.cfg = self.model.cfg
        family = self.model.family
        check_config(self.cfg)
        self.mesh = self.model.mesh
        if config.backend == "megakernel":  # fail before any weight work: what the kernel does not cover
            try:
                family.megakernel(self.cfg)
                if self.mesh is not None:  # tensor (and expert) parallel: the kernel's shards must be even
                    from weld.models import megakernel

                    megakernel.check_mesh(self.cfg, self.mesh)
                    self.cfg = megakernel.tensor_parallel_config(self.cfg, self.mesh)
            except ValueError as err:
                raise InvalidInputError(f"backend 'megakernel': {err}") from None
        self.tokenizer = load_tokenizer(self.model)
        sched, cache = config.scheduler, config.cache
        self.max_model_len = min(sched.max_model_len or self.cfg.max_position_embeddings,
                                 self.cfg.max_position_embeddings)
        eos = tuple(dict.fromkeys(tuple(self.tokenizer.eos_token_ids) + tuple(self.cfg.eos_token_ids)))
        one_device = self.mesh is None
        target = WeightTarget.on_this_host(config.backend, self.dtype, one_device)
        drafter, draft_params, spec = self._load_drafter(config.speculative, target, progress)
        self.model.weights = family.prepare_weights(self.model.weights, self.cfg, target)
        if self.mesh is not None:
            self.model.weights = sharding.place(self.model.weights, sharding.weight_shardings(
                self.model.weights, family.weight_specs(self.cfg), self.mesh))
        groups = family.cache_spec(self.cfg).page_groups()
        layouts = self._cache_layouts(family, config)
        num_pages, num_slots, num_snapshot_slots = self._cache_sizes(family, drafter, config, layouts)
        # A device drafter keeps per-token state on group 0's pages for the whole context: then
        # no group frees its pages as a window moves.
        windows = tuple(None if _keeps_state(drafter) else g.window for g in groups)
        # Snapshots of a hybrid model's state at least a full prefill chunk apart: the scheduler
        # ends calls at them, so closer ones would cut a long prompt's prefill into smaller calls.
        interval = max(SNAPSHOT_INTERVAL, sched.max_num_batched_tokens // cache.page_size)
        ranks = sharding.data_parallel_size(self.mesh)
        if ranks > 1:  # data-parallel attention: each rank its own share of the pages and slots
            per_seq = self._pages_per_sequence(family, drafter, config)
            num_pages = tuple(max(-(-n // ranks), least if cache.num_pages is None else 1)
                              for n, least in zip(num_pages, per_seq))
            num_slots, num_snapshot_slots = -(-num_slots // ranks), -(-num_snapshot_slots // ranks)
            block_manager = DataParallelBlockManager(ranks, num_pages, cache.page_size, cache.enable_prefix_caching,
                                                     windows=windows, num_slots=num_slots,
                                                     num_snapshot_slots=num_snapshot_slots, snapshot_interval=interval)
            num_pages = tuple(n * ranks for n in num_pages)  # the pools: every rank's pages
        else:
            block_manager = BlockManager(num_pages, cache.page_size, cache.enable_prefix_caching, windows=windows,
                                         num_slots=num_slots, num_snapshot_slots=num_snapshot_slots,
                                         snapshot_interval=interval)
        runner = ModelRunner(family, self.cfg, self.model.weights, num_pages=num_pages,
                             page_size=cache.page_size, kv_dtype=self.kv_dtype, max_model_len=self.max_model_len,
                             steps_per_call=sched.steps_per_call, eos_token_ids=eos, backend=config.backend,
                             drafter=drafter, draft_params=draft_params, num_spec_tokens=spec.k,
                             spec_widths=spec.widths(), spec_rounds=spec.rounds(sched.steps_per_call),
                             num_state_slots=block_manager.num_state_slots, mesh=self.mesh,
                             stream_interval=sched.stream_interval,
                             cache_layouts=None if layouts is None else layouts[1])
        scheduler = Scheduler(block_manager, sched.max_num_seqs, sched.max_num_batched_tokens,
                              max_model_len=self.max_model_len,
                              steps_per_call=sched.steps_per_call, num_spec_tokens=spec.k,
                              spec_rounds=spec.rounds(sched.steps_per_call))
        self.engine = EngineCore(runner, self.tokenizer, scheduler, max_model_len=self.max_model_len,
                                 eos_token_ids=eos, proposer=_host_proposer(spec))
        if self.channel is not None:  # rank 0 sends every device call to the others; they replay them
            self.channel.attach(self)
        self._counter = itertools.count()
        self._progress = progress
        release_free_memory()  # the loader's temporaries
        logger.info("weights on device: %.2f GB (%s, quantization %s); KV cache: %s pages of %d tokens, %.2f GB %s; "
                    "max_model_len %d, max_num_seqs %d", _nbytes(self.model.weights) / 1e9, jnp.dtype(self.dtype).name,
                    config.load_quantization or "as stored", "+".join(map(str, num_pages)), cache.page_size,
                    _nbytes(runner.cache) / 1e9, jnp.dtype(self.kv_dtype).name, self.max_model_len, sched.max_num_seqs)

    def _mesh(self, family, config: EngineConfig, cfg: Any = None):
        """The device mesh of config.parallel (None: one device), its layout checked against the
        model's config (cfg, or self.cfg)."""
        cfg = self.cfg if cfg is None else cfg
        parallel = config.parallel
        if not parallel.sharded:
            return None
        try:
            mesh = sharding.make_mesh(parallel.tensor_parallel_size, parallel.data_parallel_size,
                                      parallel.enable_expert_parallel, parallel.expert_tensor_parallel_size)
            sharding.check_layout(cfg, family.cache_spec(cfg), mesh)
        except ValueError as err:
            raise InvalidInputError(str(err)) from None
        return mesh

    def _cache_layouts(self, family, config: EngineConfig) -> Any:
        """(a nominal cache, its layouts) when the engine picks them (`sharding.pool_layouts`
        "auto": the XLA backend on a TPU; `runner.auto_cache_layouts`: a tree of `Layout`s like
        any cache of the model's, whatever its size), else None."""
        if sharding.pool_layouts(config.backend, self.mesh) != "auto":
            return None
        from weld.engine.runner import auto_cache_layouts

        spec = family.cache_spec(self.cfg)
        nominal = jax.eval_shape(lambda: spec.create(NOMINAL_PAGES, config.cache.page_size, self.kv_dtype,
                                                     num_slots=NOMINAL_PAGES if spec.has_recurrent else 0))
        return nominal, auto_cache_layouts(family, self.cfg, self.model.weights, nominal)

    def _cache_sizes(self, family, drafter, config: EngineConfig,
                     layouts: Any = None) -> tuple[tuple[int, ...], int, int]:
        """(pages of each page group (`CacheSpec.page_groups`), live recurrent-state slots,
        snapshot slots).

        Pages: with cache.num_pages, that many in every group. Else kv_cache_memory_gb (default:
        what max_num_seqs sequences take, at most DEFAULT_KV_CACHE_GB) is shared so that every
        group holds the same number of sequences: a full-context group needs max_model_len tokens
        of pages per sequence, a sliding group its window plus a prefill chunk and a call's decode
        steps (its older pages are freed as it moves on). A drafter's state lives on group 0's
        pages and counts there. At least one sequence of max_model_len always fits.

        Slots: a model with linear-attention layers keeps a recurrent state per sequence
        (`CacheSpec.bytes_per_sequence`, f32): one live slot for each of max_num_seqs sequences,
        and, with prefix caching, snapshot slots for SNAPSHOT_SHARE of the memory (at least
        MIN_SNAPSHOT_SLOTS). They come out of the budget before the pages (the default one grows
        past DEFAULT_KV_CACHE_GB if it must to hold them and one sequence); a kv_cache_memory_gb
        too small for them and one sequence's pages is an error. Without such layers both are 0.
        """
        cache, sched = config.cache, config.scheduler
        spec = family.cache_spec(self.cfg)
        groups = spec.page_groups()
        slot_bytes = spec.bytes_per_sequence()
        live = sched.max_num_seqs if spec.has_recurrent else 0
        share = SNAPSHOT_SHARE if spec.has_recurrent and cache.enable_prefix_caching else 0.0

        def snapshots(memory: float) -> int:  # the snapshot slots of KV memory of `memory` bytes in all
            return max(MIN_SNAPSHOT_SLOTS, int(share * memory / slot_bytes)) if share else 0

        per_seq = self._pages_per_sequence(family, drafter, config)
        # device bytes: pools laid out for their programs (`sharding.pool_layouts`) carry tile padding
        measure = None
        if layouts is not None:
            chosen = _page_layouts(*layouts)
            measure = lambda shape, dtype, heads: sharding.page_bytes(  # noqa: E731
                shape, dtype, heads, layout=chosen.get((tuple(shape), jnp.dtype(dtype).name)), mesh=self.mesh)
        elif sharding.pool_layouts(config.backend, self.mesh) == "row_major":
            measure = functools.partial(sharding.page_bytes, layout="row_major", mesh=self.mesh)
        page_bytes = [spec.page_bytes(self.kv_dtype, cache.page_size, i, measure) for i in range(len(groups))]
        if _keeps_state(drafter):
            page_bytes[0] += drafter.cache_spec().page_bytes(self.kv_dtype, cache.page_size, measure=measure)
        if cache.num_pages:
            memory = cache.num_pages * sum(page_bytes) + live * slot_bytes
            return (cache.num_pages,) * len(groups), live, snapshots(memory / (1 - share))
        seq_bytes = sum(n * b for n, b in zip(per_seq, page_bytes))
        if cache.kv_cache_memory_gb is None:
            default = int(DEFAULT_KV_CACHE_GB * (1 << 30))
            num_snapshots = snapshots(min(default, sched.max_num_seqs * (seq_bytes + slot_bytes) / (1 - share)))
            rest = min(sched.max_num_seqs * seq_bytes, default - (live + num_snapshots) * slot_bytes)
        else:
            budget = int(cache.kv_cache_memory_gb * (1 << 30))
            num_snapshots = snapshots(budget)
            rest = budget - (live + num_snapshots) * slot_bytes
        if spec.has_recurrent and rest < seq_bytes:
            if cache.kv_cache_memory_gb is not None:
                kept = f" and {num_snapshots} prefix-cache snapshots" if num_snapshots else ""
                raise InvalidInputError(
                    f"kv_cache_memory_gb={cache.kv_cache_memory_gb:g} cannot hold this model's recurrent state for "
                    f"max_num_seqs={sched.max_num_seqs} sequences{kept} ({slot_bytes / (1 << 20):.2f} MiB each) "
                    f"and the pages of one sequence of max_model_len tokens ({seq_bytes / (1 << 20):.2f} MiB): "
                    "raise kv_cache_memory_gb or lower max_num_seqs")
            rest = seq_bytes
        sequences = rest / seq_bytes
        return tuple(max(int(sequences * n), n) for n in per_seq), live, num_snapshots

    def _pages_per_sequence(self, family, drafter, config: EngineConfig) -> list[int]:
        """The pages of each page group one sequence of max_model_len tokens may hold at once: the
        whole context in a full-context group, its window plus a prefill chunk and a call's decode
        steps in a sliding one (a device drafter keeps state for the whole context)."""
        cache, sched = config.cache, config.scheduler
        span = sched.max_num_batched_tokens + config.speculative.tokens_per_call(sched.steps_per_call)
        return [-(-(self.max_model_len if g.window is None or _keeps_state(drafter)
                    else min(self.max_model_len, g.window + span)) // cache.page_size) + 1
                for g in family.cache_spec(self.cfg).page_groups()]

    def _load_drafter(self, spec: SpeculativeConfig, target: WeightTarget, progress: bool | None):
        """(device drafter, its weights, the config with k settled) for the method, or Nones."""
        from weld.engine.spec import drafters

        if spec.method == "draft_model":
            draft = self._load_draft_model(spec, progress)
            weights = draft.family.prepare_weights(draft.weights, draft.cfg, dataclasses.replace(target, backend="xla"))
            return drafters.DraftModelDrafter(draft.family, draft.cfg), weights, spec
        if spec.method == "ngram":
            return drafters.NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max), None, spec
        if spec.method != "dspark":
            return None, None, spec
        from weld.engine.spec import dspark

        if spec.model is None:  # the drafter that ships for this target, if one does
            shipped = dspark.shipped_drafter(self.model.source.path)
            if shipped is None:
                raise InvalidInputError(f"no DSpark drafter ships for {self.model.source.name}: give one with --draft "
                                        "DIR (speculative_config 'model'); `weld train-draft` trains one")
            spec = dataclasses.replace(spec, model=str(shipped))
        try:
            params, dcfg = dspark.load(spec.model, dtype=self.dtype)
            dcfg.check_target(self.cfg)
        except (ValueError, OSError) as e:
            raise InvalidInputError(f"cannot use the DSpark drafter {spec.model}: {e}") from e
        if spec.k is not None and spec.k > dcfg.block_size:
            raise InvalidInputError(f"num_speculative_tokens ({spec.k}) exceeds the drafter's block size "
                                    f"({dcfg.block_size})")
        threshold = dcfg.confidence_threshold if spec.confidence_threshold is None else spec.confidence_threshold
        params = dspark.serving_params(params, dcfg, self.model.weights)
        if target.pack_for_cpu_kernels:  # the native integer kernel's form
            params = dspark.quantized(params)
        return (drafters.DSparkDrafter(dcfg, float(threshold)), params,
                dataclasses.replace(spec, k=spec.k or dcfg.block_size))

    def _load_draft_model(self, spec: SpeculativeConfig, progress: bool | None) -> LoadedModel:
        draft = load_model(resolve_model(spec.model), dtype=self.dtype, progress=progress,
                           quantization=self.config.load_quantization)
        if draft.cfg.vocab_size != self.cfg.vocab_size:
            raise InvalidInputError(
                f"the draft model's vocabulary ({draft.cfg.vocab_size} tokens) differs from the target's "
                f"({self.cfg.vocab_size}): a draft model must share the target's tokenizer")
        if draft.family.cache_spec(draft.cfg).has_recurrent:
            raise InvalidInputError("the draft model has linear-attention layers, whose recurrent state a draft model "
                                    "cannot roll back to the accepted drafts in weld yet: pick a draft model with "
                                    "attention layers only (the target may be hybrid)")
        if len(draft.family.cache_spec(draft.cfg).page_groups()) > 1:
            raise InvalidInputError("the draft model mixes sliding-window and full layers, which a draft model "
                                    "cannot have in weld yet: pick a draft model without sliding-window layers")
        if draft.cfg.max_position_embeddings < self.max_model_len:
            raise InvalidInputError(
                f"the draft model's context ({draft.cfg.max_position_embeddings}) is shorter than "
                f"max_model_len ({self.max_model_len})")
        return draft

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def warmup(self, full: bool = False) -> None:
        """Compiles programs now (with progress on stderr) instead of at the first requests.

        By default the batch-1 prefill and decode; with `full`, every shape the scheduler can
        produce under max_num_seqs and max_num_batched_tokens, so that requests with default
        sampling never wait for a compile (logprobs and penalties still compile their variants
        on first use). Compiled programs are cached on disk, so later runs load them quickly.
        """
        if full:
            if self.engine.has_unfinished():
                raise InvalidInputError("warm up before adding requests")
            sched = self.engine.scheduler
            self.engine.runner.warmup(sched.max_num_seqs, sched.max_num_batched_tokens, progress=self._progress)
            return
        with status("Compiling", enabled=self._progress):
            self.generate({"prompt_token_ids": [0] * 8}, SamplingParams(max_tokens=2, temperature=0))

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a string, or a dict with 'prompt' or 'prompt_token_ids'."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidInputError(
            f"a prompt is a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generates for all prompts as one continuously batched run; outputs keep the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidInputError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.encode_prompt(p) for p in prompts]  # validate everything before adding anything
        ids = []
        try:
            for (text, token_ids), p in zip(encoded, params):
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, token_ids, p, prompt=text)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with Progress(len(request_ids), "Generating", unit="req",
                      enabled=use_tqdm if use_tqdm is not None else (self._progress and len(request_ids) > 1)) as bar:
            try:
                while wanted - finished.keys():
                    for out in self.engine.step():
                        if out.finished and out.request_id in wanted:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for request_id in wanted - finished.keys():
                    self.engine.abort(request_id)
                raise
        return [finished[r] for r in request_ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of messages) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams,
               on_text: Callable[[str], None] | None = None) -> Iterable[str]:
        """Yields the new text of a single completion as it is generated (for the CLI), holding
        back what may be the start of a stop string. With on_text, each token's text goes to
        on_text as it is sampled, from another thread while a device call runs (`AsyncLLM`'s
        streaming), and the generator yields what is left after each call."""
        text, token_ids = self.encode_prompt(prompt)
        request_id = str(next(self._counter))
        self.engine.add_request(request_id, token_ids, sampling_params, prompt=text, stream=on_text is not None)
        cursor = TextCursor(sampling_params.stop)

        def partial(outputs: list[RequestOutput]) -> None:  # never while the generator runs: step() waits
            for out in outputs:
                if out.request_id == request_id and (delta := cursor.text_delta(out.outputs[0].text, out.finished)):
                    on_text(delta)

        self.engine.on_stream = partial if on_text is not None else None
        try:
            while True:
                for out in [o for o in self.engine.step() if o.request_id == request_id]:
                    delta = cursor.text_delta(out.outputs[0].text, out.finished)
                    if delta:
                        yield delta
                    if out.finished:
                        self.last_output = out
                        return
        finally:
            self.engine.on_stream = None
            self.engine.abort(request_id)


NOMINAL_PAGES = 4096  # the cache `auto_cache_layouts` compiles for (its layouts hold for any size)


def _page_layouts(nominal: Any, layouts: Any) -> dict:
    """(page shape, dtype name) -> the `Layout` `auto_cache_layouts` chose for the pools of pages
    of that shape (the first such pool's)."""
    from weld.models.common.cache import KVPages, LatentPages

    chosen: dict = {}
    for layer, laid in zip(nominal.layers, layouts.layers):
        if isinstance(layer, (KVPages, LatentPages)):
            for x, layout in zip(jax.tree_util.tree_leaves(layer), jax.tree_util.tree_leaves(laid)):
                chosen.setdefault((tuple(x.shape[1:]), jnp.dtype(x.dtype).name), layout)
    return chosen

