"""Declarative checkpoint key maps: a family's statement of which file tensor fills which weight.

A `KeyMap` maps tensor-name patterns to paths in the family's weight tree (`weight_specs(cfg)`).
In a pattern, `{i}` stands for a layer index, `{e}` for an expert index and `*` for anything:
- `"model.layers.{i}.self_attn.q_proj.weight": ("layers", "{i}", "wq")`: the tensor is the leaf;
- a pattern with `{e}` fills one slice of a stacked leaf: `experts.{e}.gate_proj.weight` ->
  ("layers", "{i}", "w_gate") fills w_gate[e] of a declared [experts, out, in] leaf (so a
  checkpoint may store experts one by one or, under another pattern, already stacked);
- `Convert(fn, path, ...)`: the tensor is converted by fn(array, cfg) into the leaf (or, with
  several paths, split into several leaves: fn returns one array per path). Used for layouts
  that differ from the tree's (llama.cpp's permuted Q/K rows, a fused gate/up, an x-major
  expert stack, GGUF's 1 + w norms).

The loaders (`weld.weights`) check every name and shape against the declared tree before any
tensor is read, and list every bad tensor at once: a name no pattern matches and no ignore
pattern covers, a leaf filled twice, a leaf or expert slice missing, a shape that differs.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

import numpy as np

Path = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Convert:
    """A tensor whose layout differs from its leaf's: fn(array, cfg) -> array, or a tuple of arrays
    (one per path) when one tensor fills several leaves. The element counts must add up.
    rows_only: fn only reorders or splits axis 0, so it applies to a quantized tensor's codes and
    scales alike (the tensor can stay quantized)."""

    fn: Callable[[np.ndarray, Any], Any]
    paths: tuple[tuple, ...]
    rows_only: bool = False

    def __init__(self, fn: Callable[[np.ndarray, Any], Any], *paths: tuple, rows_only: bool = False):
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "paths", tuple(paths))
        object.__setattr__(self, "rows_only", rows_only)


Target = tuple | Convert


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """Tensor-name patterns -> tree paths (or `Convert`s), and patterns of tensors to skip."""

    keys: dict[str, Target]
    ignore: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Match:
    """Where one checkpoint tensor goes: leaf paths, an expert slice (or None), a conversion."""

    paths: tuple[Path, ...]
    expert: int | None = None
    convert: Callable | None = None
    rows_only: bool = False  # the conversion reorders or splits rows only (`Convert.rows_only`)


@functools.lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern:
    escaped = re.escape(pattern).replace(re.escape("*"), ".*")  # `*` (ignore patterns): anything
    for name in ("i", "e"):
        escaped = escaped.replace(re.escape("{" + name + "}"), rf"(?P<{name}>\d+)")
    return re.compile(escaped + r"\Z")


def _fill(template: tuple, groups: dict) -> Path:
    return tuple(int(groups["i"]) if part == "{i}" else part for part in template)


def match(keymap: KeyMap, name: str) -> Match | None:
    """Where tensor `name` goes, or None if no pattern matches it."""
    for pattern, target in keymap.keys.items():
        m = _compile(pattern).match(name)
        if m is None:
            continue
        groups = m.groupdict()
        expert = int(groups["e"]) if groups.get("e") is not None else None
        if isinstance(target, Convert):
            return Match(tuple(_fill(p, groups) for p in target.paths), expert, target.fn, target.rows_only)
        return Match((_fill(target, groups),), expert)
    return None


def ignored(keymap: KeyMap, name: str) -> bool:
    return any(_compile(p).match(name) for p in keymap.ignore)


def expected_name(keymap: KeyMap, path: Path, expert: int | None = None) -> str:
    """The checkpoint name that would fill `path` (for error messages)."""
    for pattern, target in keymap.keys.items():
        templates = target.paths if isinstance(target, Convert) else (target,)
        if ("{e}" in pattern) != (expert is not None):
            continue
        for template in templates:
            if len(template) == len(path) and all(t == p or t == "{i}" for t, p in zip(template, path)):
                layer = next((p for t, p in zip(template, path) if t == "{i}"), None)
                return pattern.replace("{i}", str(layer)).replace("{e}", str(expert))
    return "?"


# ----- conversions shared by families -----

def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K permutation (HF rotate-half -> interleaved), per head.

    Rows of one head [e] are viewed as [2, e/2] (the two rotary halves) and interleaved to
    [e/2, 2]. w: [n_heads * e, ...] (a weight or a bias).
    """
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_rows`: interleaved [e/2, 2] rows per head back to HF's [2, e/2]."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def minus_one(w: np.ndarray, _cfg: Any) -> np.ndarray:
    """llama.cpp's converter stores (1 + w) norm weights (Gemma, Qwen3-Next) as 1 + w: back to w."""
    return w - 1


def split_rows(*fractions: int) -> Callable[[np.ndarray, Any], tuple[np.ndarray, ...]]:
    """A conversion splitting a tensor's axis -2 ([..., rows, in]) or its only axis into parts
    in the ratio `fractions` (e.g. a fused gate/up [E, 2 I, H] -> gate [E, I, H], up [E, I, H])."""

    def fn(w: np.ndarray, _cfg: Any) -> tuple[np.ndarray, ...]:
        axis = -2 if w.ndim >= 2 else 0
        unit = w.shape[axis] // sum(fractions)
        cuts = np.cumsum([f * unit for f in fractions])[:-1]
        return tuple(np.split(w, cuts, axis=axis))

    return fn
