"""Logical axes -> mesh axes: one rules table, the mesh of a parallel layout, and the shardings
of weights, caches and batch rows that follow from them.

Model code names logical axes only (`WeightSpec.axes`: "q_heads", "mlp", "experts", ...). A
layout is a mesh (`make_mesh`) whose axis names say what it splits:

    ("dp", "tp")          tensor parallel (tp) x data parallel (dp)
    ("dp", "ep", "tp")    with expert parallelism: attention and dense MLPs over ep x tp (every
                          tensor-parallel device), routed experts over dp x ep, each expert's FFN
                          over tp (the "expert tensor parallel" size; 1 by default, as vLLM's
                          --enable-expert-parallel). The seeds' Kimi layout, attention over all 32
                          cores and experts TP4 x EP8, is dp 1, ep 8, tp 4.

Data parallelism splits attention too (vLLM's and SGLang's "DP attention"): each dp rank has
its own shard of every page pool (the pages axis over "dp", local page ids), runs only its own
sequences' rows (`weld.engine.batch.rank_rows`) and keeps their pages
(`weld.engine.block_manager.DataParallelBlockManager`), so the KV and MLA latent caches are
split over dp as well as over the heads. Rows and pools meet in one `shard_map`
(`attention._local`).

`RULES` maps each logical axis to the mesh axes it may be split over, in order; a weight's
dimension is split over those present in the mesh whose sizes multiply to a divisor of it
(dropping from the front until they do, else it stays whole). Heads and experts must divide
(`check_layout` says so, naming the numbers) except KV heads, which are replicated when there
are fewer of them than tensor-parallel devices.

The programs are one SPMD program per call (GSPMD places the collectives from these
shardings); the routed experts under expert parallelism run in `shard_map` (each device
computes its own experts for every token, then one sum over the devices: `moe.experts`). The
mesh is active while the runner traces (`jax.sharding.set_mesh`): `active_mesh()` is how model
code asks, and the native CPU kernels, which run on one device's buffers, step aside under it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from weld.models.common.spec import iter_specs, path_str

TENSOR = ("ep", "tp")  # the tensor-parallel devices: every device of a dp group
RULES: dict[str, tuple[str, ...]] = {
    "q_heads": TENSOR,
    "kv_heads": TENSOR,
    "mlp": TENSOR,
    "vocab": TENSOR,
    "linear_heads": TENSOR,
    "experts": ("dp", "ep"),  # only under expert parallelism (a mesh with an "ep" axis)
    "expert_mlp": ("tp",),
    "batch": ("dp",),
    "pages": ("dp",),  # data-parallel attention: each dp rank its own pages of every pool
    "slots": ("dp",),  # and its own block of the recurrent-state slots (rank-major ids)
    # replicated: "embed" (the residual stream), "latent" / "q_lora" (MLA's compressed widths,
    # shared by every head), "moe", DSpark's "markov" and "target_stack"
}
# Leaves made at preparation, not declared, that are split all the same (by their name): KDA's
# three convs fused as one [C, K], over its channels (`linear_attention.group_channels`)
PREPARED_AXES: dict[str, tuple[str | None, ...]] = {"conv": ("linear_heads", None)}


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
              expert_tensor_parallel_size: int | None = None, devices: list | None = None) -> Mesh:
    """The mesh of a layout over the first tp x dp devices (every process's, `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp * dp > len(devices):
        raise ValueError(f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {tp * dp} devices; "
                         f"{len(devices)} {'is' if len(devices) == 1 else 'are'} available "
                         f"({devices[0].platform}: {len(devices)} device{'s' if len(devices) != 1 else ''})")
    chosen = np.array(devices[:tp * dp], dtype=object)
    if enable_expert_parallel:
        etp = expert_tensor_parallel_size or 1
        if tp % etp:
            raise ValueError(f"expert_tensor_parallel_size {etp} does not divide tensor_parallel_size {tp}")
        return Mesh(chosen.reshape(dp, tp // etp, etp), ("dp", "ep", "tp"))
    return Mesh(chosen.reshape(dp, tp), ("dp", "tp"))


def active_mesh() -> Any:
    """The mesh the programs are being traced under (`jax.sharding.set_mesh`), or None on one
    device and inside a `shard_map` (whose body sees its device's own shards)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    split = [name for name, size in zip(mesh.axis_names, mesh.axis_sizes) if size > 1]
    if not split or set(split) <= set(mesh.manual_axes):  # inside a shard_map: each device's own buffers
        return None
    return mesh


def mesh_axes(mesh: Any, logical: str | None) -> tuple[str, ...]:
    """The mesh axes (of size > 1) a logical axis may be split over in this mesh."""
    if logical is None or logical not in RULES:
        return ()
    if logical == "experts" and "ep" not in mesh.axis_names:
        return ()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return tuple(a for a in RULES[logical] if sizes.get(a, 1) > 1)


def axis_size(mesh: Any, axes: tuple[str, ...]) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(sizes[a] for a in axes)


def partition(mesh: Any, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
    """The PartitionSpec of an array with these logical axes and shape: each dimension over its
    rule's mesh axes, dropping from the front until their sizes divide it; a mesh axis splits
    at most one dimension."""
    used: set[str] = set()
    out = []
    for name, size in zip(axes, shape):
        cand = tuple(a for a in mesh_axes(mesh, name) if a not in used)
        while cand and size % axis_size(mesh, cand):
            cand = cand[1:]
        used.update(cand)
        out.append(None if not cand else cand[0] if len(cand) == 1 else cand)
    return P(*out)


def _count(mesh: Any, axes: tuple[str, ...]) -> int:
    return axis_size(mesh, axes) if axes else 1


def check_layout(cfg: Any, cache_spec: Any, mesh: Mesh) -> None:
    """ValueError (naming the numbers) when the model's heads or experts do not divide over the
    layout's devices; KV heads may be fewer than the tensor-parallel devices (then replicated)."""
    from weld.models.common.cache import PagedKV

    tensor = _count(mesh, mesh_axes(mesh, "q_heads"))
    mla = getattr(cfg, "mla", None)
    heads = getattr(cfg, "num_heads", None) or (mla.num_heads if mla is not None else None)
    counts = [("attention heads", heads)] if heads else []
    linear = getattr(cfg, "linear", None)
    if linear is not None:
        counts.append(("linear-attention value heads", linear.num_v_heads))
    for what, n in counts:
        if n % tensor:
            raise ValueError(f"tensor_parallel_size {tensor} does not divide the model's {n} {what}")
    for kv in sorted({layer.kv_heads for layer in cache_spec.layers if isinstance(layer, PagedKV)}):
        if kv >= tensor and kv % tensor:
            raise ValueError(f"tensor_parallel_size {tensor} does not divide the model's {kv} KV heads")
        if kv < tensor and tensor % kv:
            raise ValueError(f"the model's {kv} KV heads do not divide tensor_parallel_size {tensor} (fewer KV "
                             "heads than devices are replicated, which needs a whole number of copies)")
    moe = getattr(cfg, "moe", None)
    if moe is not None:
        ep = _count(mesh, mesh_axes(mesh, "experts"))
        if moe.num_experts % ep:
            raise ValueError(f"the model's {moe.num_experts} routed experts do not divide over {ep} expert-parallel "
                             "devices (tensor_parallel_size x data_parallel_size / expert_tensor_parallel_size)")
        etp = _count(mesh, mesh_axes(mesh, "expert_mlp"))
        if moe.intermediate_size % etp:
            raise ValueError(f"the experts' intermediate size {moe.intermediate_size} does not divide over "
                             f"{etp} devices")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def weight_shardings(weights: Any, specs: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every array leaf of a (prepared) weight tree: by its `WeightSpec`'s
    logical axes where the tree has the declared leaf at that path and shape, by
    `PREPARED_AXES` for the few undeclared leaves named there, and whole (replicated) for the
    other weights made at preparation."""
    declared = {path_str(path): spec for path, spec in iter_specs(specs)}

    def leaf(path, x):
        keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
        spec = declared.get(path_str(keys))
        if spec is not None and tuple(spec.shape) == tuple(np.shape(x)):
            return NamedSharding(mesh, partition(mesh, spec.axes, tuple(spec.shape)))
        axes = PREPARED_AXES.get(keys[-1]) if keys else None
        if spec is None and axes is not None and len(axes) == np.ndim(x):
            return NamedSharding(mesh, partition(mesh, axes, tuple(np.shape(x))))
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(leaf, weights)


def data_parallel_size(mesh: Any) -> int:
    """How many data-parallel ranks split the rows and the page pools (1: none, or no mesh)."""
    return 1 if mesh is None else _count(mesh, mesh_axes(mesh, "pages"))


def local_slots(slots: jax.Array, pool_slots: int, mesh: Any) -> jax.Array:
    """Inside a `shard_map` over mesh: the global recurrent-state slot ids `slots` (rank-major,
    `DataParallelBlockManager`; -1: none) as ids into this rank's block of a pool of pool_slots
    slots split over the ranks (`cache_shardings`)."""
    ranks = mesh_axes(mesh, "slots")
    if not ranks:
        return slots
    block = pool_slots // axis_size(mesh, ranks)
    return jnp.where(slots >= 0, slots - jax.lax.axis_index(ranks[0] if len(ranks) == 1 else ranks) * block, -1)


def kv_pool_axes(mesh: Any, kv_heads: int) -> tuple[str, ...]:
    """The mesh axes a pool's KV-head dimension is split over: every tensor-parallel device when
    they divide the KV heads, else none (the pool is whole on each: fewer KV heads than devices,
    or MLA's one latent head). Never a part of them: a device's query heads then read KV heads
    another device would hold."""
    axes = mesh_axes(mesh, "kv_heads")
    return axes if axes and kv_heads % axis_size(mesh, axes) == 0 else ()


def spec_of(*dims: tuple[str, ...] | None) -> P:
    """A PartitionSpec from per-dimension mesh-axis tuples (None or (): whole)."""
    return P(*(None if not d else d[0] if len(d) == 1 else d for d in dims))


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """Shardings of a `cache.Cache`: K/V pools [pages, page, kv_heads x head_dim] over their pages
    (data-parallel ranks) and KV heads (`kv_pool_axes`: the rows' lanes in whole heads), MLA's latent pool over its pages
    (every head reads it), recurrent states [slots, heads, dk, dv] over their slots (each rank
    its own block, `DataParallelBlockManager`) and heads, the conv windows [slots, channels, K -
    1] likewise over their slots and channels (contiguous: each device its heads' when the
    channels are grouped, `DeltaNet.shards`). A pool whose pages or slots do not divide over the
    ranks is a ValueError."""
    from weld.models.common.cache import KVPages, LatentPages, RecurrentState

    def split(pool: Any, logical: str = "pages") -> tuple[str, ...]:  # dim 0 over the ranks of rule `logical`
        ranks = mesh_axes(mesh, logical)
        if ranks and pool.shape[0] % axis_size(mesh, ranks):
            what = "state slots" if logical == "slots" else logical
            raise ValueError(f"{pool.shape[0]} {what} do not divide over {axis_size(mesh, ranks)} data-parallel ranks")
        return ranks

    def slots(pool: Any, axes: tuple[str | None, ...]) -> NamedSharding:
        heads = partition(mesh, (None,) + axes, pool.shape)[1:]
        return NamedSharding(mesh, P(spec_of(split(pool, "slots"))[0], *heads))

    def of(layer):
        if isinstance(layer, KVPages):
            s = NamedSharding(mesh, spec_of(split(layer.k), None, kv_pool_axes(mesh, layer.kv_heads)))
            return dataclasses.replace(layer, k=s, v=s)
        if isinstance(layer, LatentPages):
            return LatentPages(pool=NamedSharding(mesh, spec_of(split(layer.pool))))
        if isinstance(layer, RecurrentState):
            return RecurrentState(conv=slots(layer.conv, ("linear_heads", None)),
                                  state=slots(layer.state, ("linear_heads",) + (None,) * (layer.state.ndim - 2)))
        return jax.tree_util.tree_map(lambda _: replicated(mesh), layer)

    return type(cache)(layers=[of(layer) for layer in cache.layers])


def pool_layouts(backend: str, mesh: Any) -> str | None:
    """How the engine lays out the cache's page pools on the device. XLA's default TPU layout of
    a pool [pages, page, kv_heads x head_dim] suits the array alone: row-major only for rows a
    whole number of lane tiles wide, else a denser order (for SmolLM2's 192 or MLA's 576 at
    thousands of pages, the pages axis minor; probed with libtpu). The programs that read the
    pools want another, and XLA relaid out every pool in and out of each step (SmolLM2's
    widths, 30 layers, batch 8, 4,096-page pools: the megakernel 25 ms a step, the XLA backend
    42 ms, measured with [pages, page, kv_heads, head_dim] pools).

    "row_major": the megakernel on a TPU (a Pallas call takes its operands row-major): the KV
      and latent pools row-major, at the cost of tile padding (rows padded to whole lane tiles:
      SmolLM2's 192 to 256, 1.33x the bytes; `page_bytes` counts it).
    "auto": the XLA backend on one TPU: every cache array in the layout XLA picks for one
      decode step (`Layout.AUTO`; `weld.engine.runner.auto_cache_layouts`).
    None: XLA's defaults (CPU and GPU, whose arrays are row-major; XLA programs over a mesh of
      TPUs: not done yet)."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    if device.platform != "tpu":
        return None
    if backend == "megakernel":
        return "row_major"
    return "auto" if mesh is None else None


def row_major(ndim: int) -> Any:
    from jax.experimental.layout import Layout

    return Layout(major_to_minor=tuple(range(ndim)))


def cache_placement(cache: Any, mesh: Any, *, row_major_pools: bool = False, layouts: Any = None,
                    device: Any = None) -> Any:
    """Where and how a `cache.Cache`'s arrays lie, for its creation and every program's
    out_shardings: `cache_shardings` over a mesh (else on `device`, default the first), with
    each array in its layout of `layouts` (a tree like cache's of `Layout`s: "auto" in
    `pool_layouts`), or each page pool row-major when row_major_pools (the recurrent states in
    XLA's layouts). None: nothing to declare (one device, XLA's default layouts)."""
    from jax.experimental.layout import Format
    from jax.sharding import SingleDeviceSharding

    from weld.models.common.cache import KVPages, LatentPages

    if mesh is None and not row_major_pools and layouts is None:
        return None
    if mesh is not None:
        shardings = cache_shardings(cache, mesh)
    else:
        one = SingleDeviceSharding(device or jax.devices()[0])
        shardings = type(cache)(layers=[jax.tree_util.tree_map(lambda _: one, layer) for layer in cache.layers])
    if layouts is not None:
        return jax.tree_util.tree_map(Format, layouts, shardings)
    if not row_major_pools:
        return shardings

    def of(layer, placed):
        if not isinstance(layer, (KVPages, LatentPages)):
            return placed
        return jax.tree_util.tree_map(lambda x, s: Format(row_major(x.ndim), s), layer, placed)

    return type(cache)(layers=[of(layer, placed) for layer, placed in zip(cache.layers, shardings.layers)])


def page_bytes(shape: tuple[int, ...], dtype: Any, heads: int = 1, *, layout: Any = "row_major", mesh: Any = None,
               device: Any = None) -> int:
    """Device bytes of one page [page, heads x head_dim] of a pool laid out as `layout` (the
    pool's `Layout`, or "row_major"; None: its logical size): what the compiler gives a page,
    tile padding included (asked of XLA for `device`, default the first), over a mesh each
    KV-head shard padded on its own (`kv_pool_axes`)."""
    if layout is None:
        return math.prod(shape) * jnp.dtype(dtype).itemsize
    page, width = shape
    shards = axis_size(mesh, kv_pool_axes(mesh, heads)) if mesh is not None else 1
    layout = row_major(len(shape) + 1) if layout == "row_major" else layout
    return shards * _page_bytes((page, width // shards), jnp.dtype(dtype).name, layout, device or jax.devices()[0])


@functools.lru_cache(maxsize=64)
def _page_bytes(shape: tuple[int, ...], dtype: str, layout: Any, device: Any) -> int:
    from jax.experimental.layout import Format

    pages = 128  # enough pages that a layout with them minor fills its tiles
    one = NamedSharding(Mesh(np.array([device]), ("one",)), P())
    compiled = jax.jit(lambda: jnp.zeros((pages,) + shape, dtype), out_shardings=Format(layout, one)).lower().compile()
    return -(-compiled.memory_analysis().output_size_in_bytes // pages)


def place(tree: Any, shardings: Any) -> Any:
    """tree's arrays laid out by shardings (a tree of the same structure). Across processes each
    builds its own shards from its copy (`jax.make_array_from_callback`). Arrays already laid out
    as asked (a sharded load, `weld.weights.load_model`'s mesh_for) are kept as they are."""
    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
            return x
        if s.is_fully_addressable:
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    return jax.tree_util.tree_map(put, tree, shardings)


def local_rows(n: int) -> int:
    """How many of n batch rows each device computes under the active mesh: n / dp when the
    data-parallel ranks split them (`shard_rows`), else n."""
    mesh = active_mesh()
    axes = () if mesh is None else mesh_axes(mesh, "batch")
    if not axes or n % axis_size(mesh, axes):
        return n
    return n // axis_size(mesh, axes)


def shard_rows(x: jax.Array) -> jax.Array:
    """x [b, ...] with its rows split over the data-parallel devices of the active mesh (when
    they divide b): the batch dimension GSPMD then carries through the forward."""
    mesh = active_mesh()
    if mesh is None or x.ndim == 0:
        return x
    axes = mesh_axes(mesh, "batch")
    if not axes or x.shape[0] % axis_size(mesh, axes):
        return x
    return jax.lax.with_sharding_constraint(x, P(axes[0] if len(axes) == 1 else axes))
