"""Filling a family's declared weight tree from checkpoint tensors, shared by the GGUF and HF loaders.

`plan_tensors` checks every name and shape against `weight_specs(cfg)` with the family's
`KeyMap` before any tensor is read, so a bad checkpoint fails in a second with every problem
listed; `fill_tree` then reads, converts and moves one tensor at a time to the device, so host
memory never holds more than one converted tensor (an expert stored one by one is written into
its stack on the device).
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common import checkpoint, quant
from weld.models.common.checkpoint import KeyMap, Match
from weld.models.common.spec import Path, iter_specs, path_str, set_path
from weld.utils.errors import WeldError
from weld.utils.progress import Progress

DTYPES = ("float32", "bfloat16", "float16")


class CheckpointError(WeldError, ValueError):
    """The checkpoint's tensors do not match what the model declares (names or shapes)."""


def parse_dtype(dtype: Any) -> np.dtype:
    """"float32" | "bfloat16" | "float16", as a string or a jnp dtype, to a numpy dtype."""
    try:
        parsed = jnp.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed is None or parsed.name not in DTYPES:
        raise WeldError(f"unsupported weight dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return parsed


def _listing(what: str, items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")
    return f"{len(items)} {what}: {shown}"


@dataclasses.dataclass(frozen=True)
class Planned:
    """One checkpoint tensor and where it goes."""

    name: str
    match: Match
    shape: tuple[int, ...] | None = None  # as the file stores it


def plan_tensors(where: str, shapes: Mapping[str, tuple[int, ...]], keymap: KeyMap, specs: Any) -> list[Planned]:
    """Maps the checkpoint's tensors onto the declared leaves (and expert slices).

    shapes: tensor name -> shape as the file stores it ([out, in] for matrices).
    Raises CheckpointError (one line, naming the tensors) for unmapped, unexpected, missing or
    doubly mapped tensors and for shape mismatches.
    """
    declared = dict(iter_specs(specs))
    filled: dict[tuple[Path, int | None], str] = {}  # (leaf, expert or None) -> tensor
    plan: list[Planned] = []
    unmapped, unexpected, doubled, mismatched = [], [], [], []
    for name, shape in shapes.items():
        if checkpoint.ignored(keymap, name):
            continue
        m = checkpoint.match(keymap, name)
        if m is None:
            unmapped.append(name)
            continue
        bad = [p for p in m.paths if p not in declared]
        if bad:
            unexpected.append(f"{name} (-> {path_str(bad[0])}, which this config does not declare)")
            continue
        clash = [_clash(filled, p, m.expert, declared) for p in m.paths]
        clash = [c for c in clash if c]
        if clash:
            doubled.append(f"{name} and {clash[0][1]} (both -> {path_str(clash[0][0])})")
            continue
        for p in m.paths:
            filled[(p, m.expert)] = name
        plan.append(Planned(name, m, tuple(shape)))
        targets = [_slice_shape(declared[p].shape, m.expert) for p in m.paths]
        if None in targets:
            mismatched.append(f"{name} is expert {m.expert}, but {path_str(m.paths[0])} holds "
                              f"{declared[m.paths[0]].shape[0]} experts")
        elif m.convert is None and tuple(shape) != targets[0]:
            mismatched.append(f"{name} has shape {tuple(shape)}, expected {targets[0]}")
        elif m.convert is not None and math.prod(shape) != sum(math.prod(t) for t in targets):
            mismatched.append(f"{name} has shape {tuple(shape)} ({math.prod(shape)} values), expected "
                              f"{' + '.join(str(t) for t in targets)}")
    missing = [f"{checkpoint.expected_name(keymap, path, e)} (-> {path_str(path)}{'' if e is None else f'[{e}]'})"
               for path, spec in declared.items() for e in _missing(filled, path, spec)]
    problems = [_listing(what, items) for what, items in (
        ("unmapped tensors", unmapped), ("unexpected tensors", unexpected),
        ("tensors mapped twice", doubled), ("missing tensors", missing),
        ("shape mismatches", mismatched)) if items]
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
    return plan


def _slice_shape(shape: tuple[int, ...], expert: int | None) -> tuple[int, ...] | None:
    if expert is None:
        return shape
    return shape[1:] if len(shape) > 1 and 0 <= expert < shape[0] else None


def _clash(filled: dict, path: Path, expert: int | None, declared: dict) -> tuple[Path, str] | None:
    """An earlier tensor that already fills (part of) this leaf or slice, if any."""
    if (path, expert) in filled:
        return path, filled[(path, expert)]
    if expert is None:  # a whole leaf clashes with any of its slices
        hit = next((t for (p, e), t in filled.items() if p == path and e is not None), None)
    else:
        hit = filled.get((path, None))
    return (path, hit) if hit else None


def _missing(filled: dict, path: Path, spec) -> list[int | None]:
    """[None] when the leaf is not filled at all, the missing expert ids when it is stacked
    from slices, [] when complete."""
    if (path, None) in filled:
        return []
    experts = [e for (p, e) in filled if p == path and e is not None]
    if not experts:
        return [None]
    return [e for e in range(spec.shape[0]) if e not in set(experts)]


def to_device(array: np.ndarray, dtype: np.dtype, mapped: bool) -> jax.Array:
    """Casts one host tensor and puts it on the device.

    mapped: the array is a view of a memory-mapped file. Then it is copied, because jax may
    alias host memory on CPU and the weights must not keep pointing into the file.
    """
    host = array.astype(dtype, copy=mapped)
    return jax.device_put(host)


@dataclasses.dataclass
class Leaf:
    """One declared leaf, read whole: a host array in the checkpoint's dtype (`mapped`: a view of
    the memory-mapped file), or a GGUF's kept blocks as a `quant.QuantWeight`."""

    path: Path
    spec: Any  # its WeightSpec
    value: Any
    mapped: bool = False


def iter_leaves(where: str, plan: Iterable[Planned], specs: Any, cfg: Any,
                read: Callable[[str], tuple[Any, bool]], nbytes: Callable[[str], int], progress: bool | None,
                skip: frozenset = frozenset(), verb: str = "loading",
                release: Callable[[str], None] | None = None) -> Iterator[Leaf]:
    """The declared leaves, each as soon as its tensors are read (read(name) -> (array,
    `quant.Blocks` or `quant.QuantWeight`; is a view of the mapped file)) and converted when its rule says so, in
    `plan`'s order (put it in file order). An expert stack stored one expert per tensor is
    gathered on the host and yielded whole. Once a tensor's leaves have been consumed,
    release(name) drops its pages of the mapped file, so host memory holds one leaf (one stack)
    beyond what was loaded. Leaves in `skip` are not yielded, and tensors that feed only them are
    not read."""
    plan = [p for p in plan if not set(p.match.paths) <= skip]
    declared = dict(iter_specs(specs))
    stacks: dict[Path, tuple[np.ndarray, set]] = {}  # path -> (stack, experts still to come)
    with Progress(sum(nbytes(p.name) for p in plan), f"{verb} {where}", unit="B", enabled=progress) as bar:
        for item in plan:
            array, mapped = read(item.name)
            m = item.match
            if isinstance(array, quant.Blocks):  # a quantized tensor kept as it is (rows converted alike)
                parts = array.map_rows(lambda a: m.convert(a, cfg)) if m.convert is not None else array
                parts = parts if isinstance(parts, tuple) else (parts,)
                mapped = False
            elif m.convert is not None:
                try:
                    parts = m.convert(array, cfg)
                except (ValueError, IndexError) as err:  # a layout the rule cannot read (np.AxisError too)
                    raise CheckpointError(f"{where}: {item.name} of shape {tuple(array.shape)} is not in the layout "
                                          f"expected for {path_str(m.paths[0])}: {err}") from None
                parts = parts if isinstance(parts, tuple) else (parts,)
                mapped = False
            else:
                parts = (array,)
            for path, part in zip(m.paths, parts, strict=True):
                if path in skip:
                    continue
                spec = declared[path]
                whole = isinstance(part, (quant.Blocks, quant.QuantWeight))  # quantized: whole leaves only
                want = spec.shape if whole else _slice_shape(spec.shape, m.expert)
                if tuple(part.shape) != want:
                    raise CheckpointError(f"{where}: {item.name} converts to shape {tuple(part.shape)} for "
                                          f"{path_str(path)}, expected {want}")
                if whole:
                    yield Leaf(path, spec, part.packed() if isinstance(part, quant.Blocks) else part, mapped)
                elif m.expert is None:
                    yield Leaf(path, spec, part, mapped)
                else:
                    if path not in stacks:
                        stacks[path] = (np.empty(spec.shape, part.dtype), set(range(spec.shape[0])))
                    stack, left = stacks[path]
                    stack[m.expert] = part
                    left.discard(m.expert)
                    if not left:
                        del stacks[path]
                        yield Leaf(path, spec, stack)
            del array, parts
            if release is not None:
                release(item.name)
            bar.update(nbytes(item.name))
    assert not stacks, f"plan_tensors let incomplete expert stacks through: {list(stacks)}"


def finished(leaf: Leaf, dtype: np.dtype, quantization: str | None) -> Any:
    """A leaf in the form it is stored and run in: quantized when quantization ("int8" | "int4",
    `quant.leaf_mode`) asks for it and the declaration allows, else cast to dtype; quantized leaves
    stay as they are under None and are dequantized under "none". A host array (a view of the
    file when leaf.mapped) or a `quant.QuantWeight`."""
    value = leaf.value
    mode = quant.leaf_mode(leaf.spec.quantize, quantization)
    if isinstance(value, quant.QuantWeight):
        if quantization is None or value.fmt == mode:
            return value
        value = np.asarray(value.unpacked())  # dequantized ("none"), or quantized again as asked
    if mode is not None:
        return quant.quantize_any(value, mode)
    return value.astype(dtype, copy=False)


@dataclasses.dataclass
class TensorSource:
    """An opened checkpoint with its tensors planned onto the family's tree (`plan_tensors`):
    `where` (named in messages and bars), the family and its Config, the plan in read order,
    read(name) -> (array, `quant.Blocks` or `quant.QuantWeight`; whether it is a view of the mapped
    file), nbytes(name), and a GGUF's key/values (None for other sources).

    read_slice(name, index) -> (a new float host array, bytes read from the file): the block
    `index` (a slice per axis of the stored shape; the first may be an int array of rows) of a
    tensor as stored, reading only what it needs; None where the source cannot. `bytes_read`
    counts the checkpoint bytes this process has read (whole tensors, or the slices of a sharded
    load)."""

    where: str
    family: ModuleType
    cfg: Any
    plan: list[Planned]
    read: Callable[[str], tuple[Any, bool]]
    nbytes: Callable[[str], int]
    metadata: dict | None = None
    release: Callable[[str], None] | None = None  # drops a tensor's mapped pages once it is copied out
    read_slice: Callable[[str, tuple], tuple[np.ndarray, int]] | None = None
    bytes_read: int = 0

    def _read_counted(self, name: str) -> tuple[Any, bool]:
        self.bytes_read += self.nbytes(name)
        return self.read(name)

    def leaves(self, progress: bool | None = None, skip: frozenset = frozenset(),
               verb: str = "loading") -> Iterator[Leaf]:
        return iter_leaves(self.where, self.plan, self.family.weight_specs(self.cfg), self.cfg, self._read_counted,
                           self.nbytes, progress, skip, verb, self.release)

    def load(self, dtype: np.dtype, progress: bool | None = None, quantization: str | None = None,
             shardings: Any = None) -> dict:
        """The weight tree on the device (`fill_tree`), or with shardings (a callable path ->
        `jax.sharding.Sharding`, or a tree of them shaped as the declaration) laid out over their
        devices, each process reading only its slices (`fill_sharded`; quantization must be
        "none": every leaf is float)."""
        if shardings is not None:
            return fill_sharded(self, dtype, shardings, progress, quantization)
        return fill_tree(self.where, self.plan, self.family.weight_specs(self.cfg), self.cfg, dtype,
                         self._read_counted, self.nbytes, progress, quantization, self.release)


def fill_tree(where: str, plan: Iterable[Planned], specs: Any, cfg: Any, dtype: np.dtype,
              read: Callable[[str], tuple[Any, bool]], nbytes: Callable[[str], int],
              progress: bool | None, quantization: str | None = None,
              release: Callable[[str], None] | None = None) -> dict:
    """The weight tree on the device: `iter_leaves`' leaves in `finished` form. `specs` is filled in
    place and returned."""
    for leaf in iter_leaves(where, plan, specs, cfg, read, nbytes, progress, release=release):
        value = finished(leaf, dtype, quantization)
        if isinstance(value, quant.QuantWeight):  # copied out of a mapped file, as to_device does
            value = jax.block_until_ready(jax.device_put(jax.tree.map(np.array, value) if leaf.mapped else value))
        else:
            value = to_device(value, dtype, leaf.mapped)
        set_path(specs, leaf.path, value)
    return specs


# ----- sharded loading: each process reads the blocks its own devices hold -----

@dataclasses.dataclass(frozen=True)
class Feed:
    """A checkpoint tensor read block by block into a leaf (expert `expert` of a stacked leaf, or
    the whole leaf when None). rows: leaf row r is the tensor's row rows[r] (a rows-only
    conversion: llama.cpp's Q/K permutation, a split of fused rows); None: rows as stored."""

    name: str
    expert: int | None
    rows: np.ndarray | None = None


def row_maps(item: Planned, cfg: Any) -> tuple[np.ndarray | None, ...] | None:
    """For each leaf of a planned tensor, which of its rows each leaf row is: None per leaf
    without a conversion; for a rows-only conversion (`Convert.rows_only`: it only reorders or
    splits axis 0) the conversion applied to the row numbers [rows, 1, ...], which it moves as it
    would move the rows. None for other conversions: they need the whole tensor."""
    m = item.match
    if m.convert is None:
        return (None,) * len(m.paths)
    if not m.rows_only or not item.shape:
        return None
    numbers = np.arange(item.shape[0]).reshape((item.shape[0],) + (1,) * (len(item.shape) - 1))
    try:
        parts = m.convert(numbers, cfg)
    except (ValueError, IndexError, TypeError):  # a rule that does not take this layout: read it whole
        return None
    parts = parts if isinstance(parts, tuple) else (parts,)
    if len(parts) != len(m.paths) or any(np.shape(p)[1:] != numbers.shape[1:] for p in parts):
        return None
    return tuple(np.asarray(p).reshape(-1) for p in parts)


def _rows_index(rows: np.ndarray) -> slice | np.ndarray:
    """Rows as a slice when they are a run (a shard of a leaf whose rows stay in order)."""
    if rows.size and rows[-1] - rows[0] + 1 == rows.size and np.array_equal(rows, np.arange(rows[0], rows[-1] + 1)):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def _once(block: Callable[[tuple], np.ndarray]) -> Callable[[tuple], np.ndarray]:
    """block(index), read once per distinct index: the devices holding copies of the same block
    (a replicated leaf, or one split over fewer devices than the mesh has) share one read."""
    done: dict[tuple, np.ndarray] = {}

    def cached(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in done:
            done[key] = block(index)
        return done[key]

    return cached


def _sharding_at(shardings: Any, path: Path) -> Any:
    if callable(shardings):
        return shardings(path)
    node = shardings
    for key in path:
        node = node[key]
    return node


def fill_sharded(src: TensorSource, dtype: np.dtype, shardings: Any, progress: bool | None,
                 quantization: str | None) -> dict:
    """The weight tree as global arrays laid out by shardings (`TensorSource.load`), built with
    `jax.make_array_from_callback`: each of this process's devices asks for its block, and only
    those blocks are read (`TensorSource.read_slice`, which counts the bytes in `bytes_read`).

    A tensor stored as its leaf (or as one expert of a stacked leaf), or converted by a rows-only
    rule, is read block by block. A tensor another conversion transforms (swapped axes, an x-major
    fused gate/up, 1 + w norms, MLA's kv_b split) is read whole, converted and then sliced, as is
    every tensor of a source without read_slice: exact, at the cost of reading all of it."""
    if quantization != "none":
        raise WeldError(f"a sharded load makes float weights: pass quantization 'none', not {quantization!r}")
    specs = src.family.weight_specs(src.cfg)
    declared = dict(iter_specs(specs))
    feeds: dict[Path, list[Feed]] = {}
    whole: list[Planned] = []
    for item in src.plan:
        maps = row_maps(item, src.cfg) if src.read_slice is not None and item.shape is not None else None
        if maps is None:
            whole.append(item)
            continue
        for path, rows in zip(item.match.paths, maps, strict=True):
            want = _slice_shape(declared[path].shape, item.match.expert)
            got = item.shape if rows is None else (rows.size, *item.shape[1:])
            if tuple(got) != want:
                raise CheckpointError(f"{src.where}: {item.name} converts to shape {tuple(got)} for "
                                      f"{path_str(path)}, expected {want}")
            feeds.setdefault(path, []).append(Feed(item.name, item.match.expert, rows))

    def read_block(feed: Feed, index: tuple) -> np.ndarray:
        if feed.rows is not None and index:
            index = (_rows_index(feed.rows[index[0]]), *index[1:])
        array, nbytes = src.read_slice(feed.name, index)
        src.bytes_read += nbytes
        return array.astype(dtype, copy=False)

    def leaf_block(spec, by_expert: dict[int | None, Feed]) -> Callable[[tuple], np.ndarray]:
        def block(index: tuple) -> np.ndarray:
            if None in by_expert:
                return read_block(by_expert[None], index)
            parts = [read_block(by_expert[e], index[1:]) for e in range(spec.shape[0])[index[0]]]
            return np.stack(parts)
        return block

    values: dict[Path, jax.Array] = {}
    read_whole = {p.name for p in whole}
    with Progress(sum(src.nbytes(p.name) for p in src.plan if p.name not in read_whole), f"loading {src.where}",
                  unit="B", enabled=progress) as bar:
        for item in src.plan:
            if item.name in read_whole:
                continue
            for path in item.match.paths:
                if path in feeds and path not in values:
                    spec, by_expert = declared[path], {f.expert: f for f in feeds[path]}
                    values[path] = jax.block_until_ready(
                        jax.make_array_from_callback(spec.shape, _sharding_at(shardings, path),
                                                     _once(leaf_block(spec, by_expert))))
                    if src.release is not None:
                        for feed in feeds[path]:
                            src.release(feed.name)
            bar.update(src.nbytes(item.name))
    for leaf in iter_leaves(src.where, whole, specs, src.cfg, src._read_counted, src.nbytes, progress,
                            verb="loading (whole tensors)", release=src.release):
        host = finished(leaf, dtype, quantization)
        values[leaf.path] = jax.block_until_ready(jax.make_array_from_callback(
            host.shape, _sharding_at(shardings, leaf.path), _once(lambda index, host=host: np.array(host[index]))))
        del host
    for path, value in values.items():
        set_path(specs, path, value)
    return specs
