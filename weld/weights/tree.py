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
        plan.append(Planned(name, m))
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
    file), nbytes(name), and a GGUF's key/values (None for other sources)."""

    where: str
    family: ModuleType
    cfg: Any
    plan: list[Planned]
    read: Callable[[str], tuple[Any, bool]]
    nbytes: Callable[[str], int]
    metadata: dict | None = None
    release: Callable[[str], None] | None = None  # drops a tensor's mapped pages once it is copied out

    def leaves(self, progress: bool | None = None, skip: frozenset = frozenset(),
               verb: str = "loading") -> Iterator[Leaf]:
        return iter_leaves(self.where, self.plan, self.family.weight_specs(self.cfg), self.cfg, self.read,
                           self.nbytes, progress, skip, verb, self.release)

    def load(self, dtype: np.dtype, progress: bool | None = None, quantization: str | None = None) -> dict:
        """The weight tree on the device (`fill_tree`)."""
        return fill_tree(self.where, self.plan, self.family.weight_specs(self.cfg), self.cfg, dtype, self.read,
                         self.nbytes, progress, quantization, self.release)


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
