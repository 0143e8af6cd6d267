"""The model runner: owns the weights, the cache and the jitted programs, and runs one plan.

`execute` = the plan's recurrent-state slot copies (prefix-cache snapshots and hits), host
arrays of bucketed shapes (`weld.engine.batch`), one jitted program (`weld.engine.programs`:
prefill, fused decode or verification), host copies of what it produced (`StepResult`). The
cache is created from the family's `cache_spec` (with `num_state_slots` recurrent-state slots
for a model with linear-attention layers) and donated to every call. `num_compiles` counts the
distinct programs asked for, keyed by what jit keys its compiled programs by (the static
arguments and the shapes and dtypes of the others).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from types import ModuleType
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from weld.engine import batch as host_batch
from weld.engine import programs, streaming
from weld.engine.sampling_params import MAX_LOGPROBS
from weld.engine.scheduler import SchedulerOutput, bucket
from weld.kernels import cpu as cpu_kernels
from weld.models.common import sharding
from weld.utils.memory import memory_maps, release_free_memory
from weld.utils.progress import Progress

logger = logging.getLogger("weld.engine")
# The share of vm.max_map_count past which the runner drops its compiled programs (`_make_room`).
MAP_BUDGET = 0.6

BACKENDS = ("xla", "megakernel")


@dataclasses.dataclass
class StepResult:
    """Host copies of what one call produced, row i for plan entry i, k for the k-th new token."""

    token_ids: np.ndarray  # [n, k] sampled ids; -1 once a row has finished (decode)
    stopped: np.ndarray  # [n] bool: the row's last token is a stop (EOS or a stop id, after min_tokens)
    logprobs: np.ndarray | None = None  # [n, k] raw logprob of the sampled id
    ranks: np.ndarray | None = None  # [n, k]
    top_ids: np.ndarray | None = None  # [n, k, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None = None  # [n, k, MAX_LOGPROBS]
    # Prompt logprobs: for entry i and fed token j, the logprob of the token after it.
    prompt_logprobs: np.ndarray | None = None  # [n, t]
    prompt_ranks: np.ndarray | None = None  # [n, t]
    prompt_top_ids: np.ndarray | None = None  # [n, t, MAX_LOGPROBS]
    prompt_top_logprobs: np.ndarray | None = None  # [n, t, MAX_LOGPROBS]
    # Verify steps, per round: drafts each row sent and how many were accepted (-1: not in that round).
    num_drafts: np.ndarray | None = None  # [n, rounds]
    num_accepted: np.ndarray | None = None  # [n, rounds]


def drop_tracing_caches() -> None:
    """Drops JAX's tracing and lowering caches (jaxprs, lowered modules; what `jax.clear_caches`
    clears besides the compiled executables): a served bundled model held ~28 MB in them after
    its first prefill and decode compiled. Programs already compiled keep running from the
    executable caches. Where the runner is told to (`drop_traces`: `weld serve`), it drops them
    on the first call after a run of compiles. The cost is tracing again: the programs compiled
    later trace their shared parts from scratch (the megakernel's engine tests ran 1.6-2x
    longer with the caches dropped; a CPU warm-up of 32 programs 5-10%)."""
    try:
        from jax._src import util
    except ImportError:  # JAX moved it: keep the caches
        return
    clear = getattr(util, "clear_all_caches", None)
    if clear is not None:
        clear()


def _step_result(rows: np.ndarray, ids: np.ndarray, stopped: np.ndarray, chosen: tuple | None) -> StepResult:
    """A call's sampled ids, stops and chosen-token logprobs (device rows), for the plan's entries."""
    result = StepResult(token_ids=ids[rows], stopped=stopped[rows])
    if chosen is not None:
        result.logprobs, result.ranks, result.top_ids, result.top_logprobs = (x[rows] for x in chosen)
    return result


def decode_forward(family: ModuleType, cfg: Any, backend: str):
    """The forward the decode and verify loops call: the family's XLA forward, or its TPU
    megakernel (interpret mode off a TPU). Prefill and mixed steps always run on XLA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return family.forward if backend == "xla" else family.megakernel(cfg)


@dataclasses.dataclass(frozen=True)
class Own:
    """In a call `ModelRunner.on_call` reports: the runner's own weights (0), cache (1), drafter
    weights (2) or drafter state (3), which every rank holds for itself."""

    index: int


def auto_cache_layouts(family: ModuleType, cfg: Any, weights: Any, cache: Any, *, rows: int = 8,
                       device: Any = None) -> Any:
    """The layouts XLA picks for the cache's arrays in one decode step of `rows` rows
    (`Layout.AUTO`, compiled, never run), as a tree like cache's of `Layout`s: the engine creates
    the cache in them and every program takes and returns it so (`sharding.pool_layouts` "auto":
    the XLA backend on a TPU). XLA's attention scores one or two rows' every head against every
    KV head and more rows by KV head (`attention.ALL_KV_HEADS_ROWS`), and the two want their
    pools laid out differently: the default is a batch that takes the second. weights and cache
    may be abstract (shapes and dtypes); device: where (a TPU topology's device compiles for a
    TPU with none attached)."""
    from jax.experimental.layout import Format, Layout

    from weld.models.common.cache import AttentionBatch

    one = SingleDeviceSharding(device or jax.devices()[0])
    auto = jax.tree_util.tree_map(lambda _: Format(Layout.AUTO, one), cache)
    abstract = lambda tree: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    row = jax.ShapeDtypeStruct((rows, 1), np.int32)
    spec = family.cache_spec(cfg)
    tables = jax.ShapeDtypeStruct((rows, 8 * len(spec.page_groups())), np.int32)
    slots = jax.ShapeDtypeStruct((rows,), np.int32) if spec.has_recurrent else None

    def step(w, tokens, positions, c, bt, s):
        return family.forward(w, cfg, tokens, positions, c, AttentionBatch(block_tables=bt, state_slots=s))[2]

    compiled = jax.jit(step, in_shardings=(one, one, one, auto, one, one), out_shardings=auto, donate_argnums=(3,)
                       ).trace(abstract(weights), row, row, abstract(cache), tables, slots).lower().compile()
    return jax.tree_util.tree_map(lambda f: f.layout, compiled.input_formats[0][3])


def _rows_split(forward):
    """forward with its batch rows split over the mesh's data-parallel devices (`sharding.shard_rows`)."""
    def split(weights, cfg, tokens, positions, *rest, **kwargs):
        tokens, positions = jax.tree_util.tree_map(sharding.shard_rows, (tokens, positions))
        return forward(weights, cfg, tokens, positions, *rest, **kwargs)

    return split


class ModelRunner:
    """drafter: a device drafter (`weld.engine.spec.drafters`) with its weights draft_params, or
    None; its state gets pools of its own over the same pages, so block tables serve both.
    num_state_slots: the recurrent-state slots of a model with linear-attention layers (the
    block manager's live and snapshot slots together; ignored for a model without them)."""

    def __init__(self, family: ModuleType, cfg: Any, weights: Any, *, num_pages: int | tuple[int, ...], page_size: int,
                 kv_dtype: Any, max_model_len: int, steps_per_call: int = 8, eos_token_ids: tuple[int, ...] = (),
                 backend: str = "xla", drafter: Any = None, draft_params: Any = None, num_spec_tokens: int = 0,
                 spec_widths: tuple[int, ...] = (), spec_rounds: int = 1, num_state_slots: int = 0, mesh: Any = None,
                 stream_interval: int = 1, cache_layouts: Any = None):
        self.family = family
        self.mesh = mesh  # a device mesh (`weld.models.common.sharding`), or None: one device
        # data-parallel attention: each rank's rows and its own shard of the pools (num_pages in all)
        self.num_ranks = sharding.data_parallel_size(mesh)
        # Called with (program name, arguments, static arguments) before each device call; see `replay`.
        self.on_call: Any = None
        self.cfg = cfg
        self.weights = weights
        self.page_size = page_size
        self.max_pages_per_seq = bucket(-(-max_model_len // page_size), 8)
        spec = family.cache_spec(cfg)
        # the pools row-major (the megakernel on a TPU), or every cache array in cache_layouts
        # (`auto_cache_layouts`: the XLA backend on a TPU): `sharding.pool_layouts`
        self.row_major_pools = sharding.pool_layouts(backend, mesh) == "row_major"
        self.cache_layouts = cache_layouts
        self.num_page_groups = len(spec.page_groups())
        self.recurrent = spec.has_recurrent  # rows name their state slots (else the programs get None)
        self.cache = self._create(lambda: spec.create(num_pages, page_size, kv_dtype,
                                                      num_slots=num_state_slots if self.recurrent else 0),
                                  cache_layouts)
        self.drafter = drafter
        self.draft_params = draft_params
        group0 = num_pages if isinstance(num_pages, int) else num_pages[0]  # a drafter's state: on group 0's pages
        self.draft_state = (self._create(lambda: drafter.cache_spec().create(group0, page_size, kv_dtype))
                            if drafter is not None and drafter.cache_spec() is not None else None)
        # a drafter that reads the rows' token histories gets them whole: every position a sequence may reach
        self.history_width = self.max_pages_per_seq * page_size if drafter is not None and drafter.uses_history else 0
        if mesh is not None and draft_params is not None:
            self.draft_params = sharding.place(draft_params, jax.tree_util.tree_map(
                lambda _: sharding.replicated(mesh), draft_params))
        self.num_spec_tokens = num_spec_tokens
        self.spec_widths = spec_widths  # the drafts per round a verification may take (each its own program)
        self.spec_rounds = spec_rounds  # speculative rounds per device call
        self.steps_per_call = steps_per_call
        self.eos_token_ids = np.asarray(sorted(set(eos_token_ids)) or [-1], np.int32)
        self._programs: set[tuple] = set()  # the keys of the programs compiled and held now
        self._num_compiles = 0
        self._traced = False  # programs compiled since JAX's tracing caches were last dropped
        # drop JAX's tracing caches on the first call after a run of compiles (`drop_tracing_caches`):
        # what a long-lived server sets (memory); off, the next compiles reuse the traces
        self.drop_traces = False
        self.num_evictions = 0  # times `_make_room` dropped every compiled program
        decode_fwd = decode_forward(family, cfg, backend)  # the verification block runs where decode runs
        prefill_fwd = family.forward
        out = {}
        if mesh is not None:
            prefill_fwd, decode_fwd = _rows_split(prefill_fwd), _rows_split(decode_fwd)
        if mesh is not None or self._cache_shardings is not None:  # the caches keep their placement; what comes
            # back to the host is whole
            whole = sharding.replicated(mesh) if mesh is not None else SingleDeviceSharding(jax.devices()[0])
            caches = (self._cache_shardings, self._draft_shardings)
            out = {"prefill": (*caches, whole, whole, whole, whole),
                   "verify": (*caches, whole, whole, whole, whole, whole),
                   "decode": (*caches, whole, whole, whole, whole), "copy": caches[0]}
        jit = lambda fn, name, **kw: jax.jit(fn, **kw, **({"out_shardings": out[name]} if out else {}))  # noqa: E731
        self._prefill = jit(functools.partial(programs.prefill, prefill_fwd, drafter), "prefill",
                            static_argnames=("cfg", "num_top", "with_prompt_logprobs"),
                            donate_argnames=("cache", "draft_state"))
        # streamed rows' tokens leave the decode and verify loops every stream_interval steps
        # (rounds): through the native mailbox on CPU (one device: the partitioner of a mesh wants
        # a sharding on every side effect), else a Python callback (`weld.engine.streaming`); an
        # interval no call reaches leaves the hand-over out of the programs
        self.stream_interval = stream_interval
        self._native_stream = mesh is None and cpu_kernels.available()
        sink = (streaming.sink(self._native_stream) if stream_interval < max(steps_per_call, spec_rounds)
                else None)
        self._verify = jit(functools.partial(programs.verify, decode_fwd, drafter, sink=sink), "verify",
                           static_argnames=("cfg", "num_top", "rounds"), donate_argnames=("cache", "draft_state"))
        self._decode = jit(functools.partial(programs.decode, decode_fwd, drafter, sink=sink), "decode",
                           static_argnames=("cfg", "steps", "num_top"), donate_argnames=("cache", "draft_state"))
        self._copy = jit(programs.copy_slots, "copy", donate_argnames=("cache",))

    def _placement(self, cache, layouts=None):
        return sharding.cache_placement(cache, self.mesh, row_major_pools=self.row_major_pools, layouts=layouts)

    @property
    def _cache_shardings(self):
        return self._placement(self.cache, self.cache_layouts)

    @property
    def _draft_shardings(self):
        return None if self.draft_state is None else self._placement(self.draft_state)

    def _create(self, make, layouts=None):
        """A cache made by make(), placed as every program takes it (`sharding.cache_placement`:
        over the mesh, made there and never whole on one device; in `layouts`, or with row-major
        pools for a TPU's megakernel)."""
        placement = self._placement(jax.eval_shape(make), layouts)
        return make() if placement is None else jax.jit(make, out_shardings=placement)()

    @property
    def num_compiles(self) -> int:
        """Programs compiled (or loaded from the compile cache) so far: each shape once, again after
        `_make_room` dropped it."""
        return self._num_compiles

    def _make_room(self) -> None:
        """Before a new program: if the process holds over MAP_BUDGET of the memory mappings the
        kernel allows, drops every compiled program (they come back from the on-disk compile cache
        in a second or two as they are used). Each XLA:CPU program holds hundreds of mappings, so
        a full warm-up of large limits (or a long-lived server's many shapes) would otherwise run
        out of them and die in LLVM ("Cannot allocate memory")."""
        usage = memory_maps()
        if usage is None or usage[0] <= MAP_BUDGET * usage[1]:
            return
        logger.warning("%d compiled programs hold %d of the %d memory mappings this process may have "
                       "(vm.max_map_count); dropping them: they reload from the compile cache when next used",
                       len(self._programs), usage[0], usage[1])
        self._programs.clear()
        jax.clear_caches()
        gc.collect()
        self.num_evictions += 1

    def _call(self, name: str, program, *args, **static):
        """Runs a jitted program, recording the key jit compiles it under (statics, tree
        structure, leaf shapes and dtypes). The runner's own trees (weights, cache, drafter
        parameters and state) keep their shapes for its lifetime, so they stand in the key as
        their position only: walking their hundreds of leaves on every call cost ~9 ms per call,
        ~1 ms of each decode step at batch 1."""
        own = (self.weights, self.cache, self.draft_params, self.draft_state)
        per_call = [("own", i) if any(a is o for o in own) else a for i, a in enumerate(args)]
        leaves, tree = jax.tree_util.tree_flatten(per_call)
        key = (name, tuple(sorted(static.items())), tree,
               tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__))) for x in leaves))
        if key not in self._programs:
            self._make_room()
            self._programs.add(key)
            self._num_compiles += 1
            start = time.perf_counter()
            out = self._run_program(name, program, args, static)
            first = per_call[len(own)] if len(per_call) > len(own) else per_call[-1]  # after the runner's own trees
            shapes = "+".join("x".join(map(str, np.shape(x))) for x in jax.tree_util.tree_leaves(first))
            mask = args[-2] if name in ("decode", "verify") else args[-1]  # (..., bitmask, stream) there
            if name != "copy" and mask is not None:
                shapes += ", grammar masks"
            logger.info("compiled %s (%s%s) in %.1f s: %d programs", name, shapes,
                        "".join(f", {k} {v}" for k, v in sorted(static.items()) if k != "cfg"),
                        time.perf_counter() - start, len(self._programs))
            self._traced = True
            release_free_memory()  # compiling frees ~100 MB of temporaries that glibc would keep
            return out
        if self._traced and self.drop_traces:  # the first call after a run of compiles (a warm-up, a new shape)
            drop_tracing_caches()  # once, not after each compile (the next compiles reuse the traces)
            release_free_memory()
            self._traced = False
        return self._run_program(name, program, args, static)

    def _run_program(self, name: str, program, args, static):
        own = (self.weights, self.cache, self.draft_params, self.draft_state)
        if self.on_call is not None:  # e.g. rank 0 of a multi-host run sends the call to the other ranks
            self.on_call(name, [next((Own(k) for k, o in enumerate(own) if a is o and o is not None), a)
                                for a in args], static)
        if self.mesh is None:
            return program(*args, **static)
        with jax.sharding.set_mesh(self.mesh):  # model code sees the mesh while tracing (`sharding.active_mesh`)
            return program(*args, **static)

    def replay(self, name: str, args: list, static: dict) -> None:
        """Runs the call another runner's `on_call` reported (its arguments, with `Own` markers
        where that runner passed its own weights, cache or drafter state), on this runner's own
        state: what the other ranks of a multi-host run do, so that every rank runs the same SPMD
        program."""
        own = (self.weights, self.cache, self.draft_params, self.draft_state)
        args = [own[a.index] if isinstance(a, Own) else a for a in args]
        program = {"prefill": self._prefill, "verify": self._verify, "decode": self._decode, "copy": self._copy}[name]
        out = self._call(name, program, *args, **static)
        if name == "copy":
            self.cache = out
        else:
            self.cache, self.draft_state = out[0], out[1]

    def execute(self, plan: SchedulerOutput, want_logprobs: bool = False,
                want_prompt_logprobs: bool = False, token_bitmask: np.ndarray | None = None,
                drafts: np.ndarray | None = None, num_drafts: np.ndarray | None = None,
                host_drafted: np.ndarray | None = None,
                on_tokens: Callable[[StepResult], None] | None = None) -> StepResult:
        """Runs `plan` (see `batch.build` for the bitmask and draft arguments), after its slot copies.
        on_tokens: a decode or verify call hands it its outputs so far (a StepResult whose rows
        are filled as far as the loop got, -1 after) every `stream_interval` steps (rounds) while
        it runs, on another thread; never after this method returns."""
        for wave in plan.slot_copies:
            self.copy_slots(wave)
        num_top = MAX_LOGPROBS if want_logprobs or want_prompt_logprobs else 0
        host = host_batch.build(plan, max_pages_per_seq=self.max_pages_per_seq, num_page_groups=self.num_page_groups,
                                num_ranks=self.num_ranks, vocab_size=self.cfg.vocab_size,
                                eos_ids=self.eos_token_ids, num_spec_tokens=plan.spec_width,
                                want_prompt_logprobs=want_prompt_logprobs, token_bitmask=token_bitmask,
                                drafts=drafts, num_drafts=num_drafts, host_drafted=host_drafted,
                                history_width=self.history_width if plan.kind == "verify" else 0)
        if self.recurrent and min(e.seq.state_slot for e in plan.entries) < 0:
            raise RuntimeError("a sequence runs without a recurrent-state slot: a model with linear-attention "
                               "layers needs a BlockManager with num_slots > 0")
        common = (host.sampling, host.stop, host.penalties)
        slots = host.state_slots if self.recurrent else None
        prompt = sent_log = None
        rows = np.asarray(host.rows)
        stream, call_id = np.zeros(2, np.int32), None  # (every, call id): 0 hands nothing over
        if on_tokens is not None and plan.kind in ("decode", "verify"):
            call_id = self._open_hand_over(plan, host, num_top, rows, on_tokens)
            stream[:] = self.stream_interval, call_id
        try:
            if plan.kind == "decode":
                self.cache, self.draft_state, ids, chosen, stopped, _ = self._call(
                    "decode", self._decode, self.weights, self.cache, self.draft_params, self.draft_state,
                    host.tokens, host.positions, host.block_tables, slots, *common, host.bitmask, stream, cfg=self.cfg,
                    steps=self.steps_per_call, num_top=num_top)
            elif plan.kind == "verify":
                self.cache, self.draft_state, ids, chosen, sent_log, stopped, _ = self._call(
                    "verify", self._verify, self.weights, self.cache, self.draft_params, self.draft_state,
                    host.tokens, host.positions, host.num_drafts, host.host_drafted, host.history, host.block_tables,
                    slots, *common, host.bitmask, stream, cfg=self.cfg, num_top=num_top, rounds=self.spec_rounds)
            else:
                tokens, positions, tables, last, group_slots = zip(*host.groups)
                self.cache, self.draft_state, ids, chosen, prompt, stopped = self._call(
                    "prefill", self._prefill, self.weights, self.cache, self.draft_params, self.draft_state, tokens,
                    positions, tables, last, group_slots if self.recurrent else None, *common, host.prompt_targets,
                    host.bitmask, cfg=self.cfg, num_top=num_top, with_prompt_logprobs=want_prompt_logprobs)
            ids, stopped, chosen, prompt, sent_log = jax.device_get((ids, stopped, chosen, prompt, sent_log))
        finally:
            if call_id is not None:
                streaming.HANDOVERS.close(call_id)
        result = _step_result(rows, ids, stopped, chosen)
        if sent_log is not None:
            result.num_drafts, result.num_accepted = (x[rows] for x in sent_log)
        if prompt is not None:  # prompt chunks only: the first num_prefill entries
            (result.prompt_logprobs, result.prompt_ranks, result.prompt_top_ids,
             result.prompt_top_logprobs) = (x[rows[:plan.num_prefill]] for x in prompt)
        return result

    def _open_hand_over(self, plan: SchedulerOutput, host: Any, num_top: int, rows: np.ndarray,
                        on_tokens: Callable[[StepResult], None]) -> int:
        """Opens the hand-over of a decode or verify call about to run: the buffers its loop fills
        (`programs.hand_over`), for on_tokens as a StepResult of the plan's entries."""
        b = host.tokens.shape[0]
        width = self.steps_per_call if plan.kind == "decode" else self.spec_rounds * host.tokens.shape[1]
        layout = [((b, width), np.int32), ((b,), np.bool_)]
        if num_top:
            layout += [((b, width), np.float32), ((b, width), np.int32), ((b, width, num_top), np.int32),
                       ((b, width, num_top), np.float32)]
        return streaming.HANDOVERS.open(
            layout, lambda arrays: on_tokens(_step_result(rows, arrays[0], arrays[1], tuple(arrays[2:]) or None)),
            native=self._native_stream)

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copies recurrent-state slots (source, destination) in one call, every source read
        before any destination is written; padded to a power of two with pairs that copy nothing."""
        n = bucket(len(copies))
        src, dst = np.full((n,), -1, np.int32), np.full((n,), -1, np.int32)
        if copies:
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
        self.cache = self._call("copy", self._copy, self.cache, src, dst)

    def warmup(self, max_num_seqs: int, max_num_batched_tokens: int, progress: bool | None = None) -> int:
        """Compiles every program shape the scheduler can ask for under these limits (with default
        sampling: no logprobs, penalties or extra stop ids, which add variants of their own), and
        the slot copies of up to 2 * max_num_seqs pairs (a step's prefix hits and snapshots).
        Runs each once on dummy sequences; call it before any request is running, since the
        dummies write into free pages and the first live state slots. Returns the number of
        programs compiled.
        """
        num_slots = self.cache.num_slots
        plans = host_batch.warmup_plans(max_num_seqs, max_num_batched_tokens, self.page_size, self.spec_widths,
                                        self.num_page_groups, num_slots, self.num_ranks,
                                        max_seq_len=self.max_pages_per_seq * self.page_size)
        copies = [1 << i for i in range(bucket(2 * max_num_seqs).bit_length())] if num_slots else []
        before = self.num_compiles
        with Progress(len(plans) + len(copies), "Compiling", unit="program", enabled=progress) as bar:
            for plan in plans:
                self.execute(plan)
                bar.update(1)
            for n in copies:
                self.copy_slots([(-1, -1)] * n)
                bar.update(1)
        return self.num_compiles - before
