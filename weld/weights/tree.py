"""Filling a family's declared weight tree from checkpoint tensors, shared by the GGUF and HF loaders.

`plan_tensors` checks every name and shape against `weight_specs(cfg)` before any tensor is
read, so a bad checkpoint fails in a second with every problem listed; `to_device` then moves
one tensor at a time to the device, so host memory never holds more than one converted tensor.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from weld.models.common.spec import Path, iter_specs, path_str
from weld.utils.errors import WeldError
from weld.weights import keymaps

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


def plan_tensors(where: str, shapes: Mapping[str, tuple[int, ...]], keymap: dict[str, tuple],
                 ignore: Iterable[str], specs: Any) -> dict[Path, str]:
    """Maps each declared leaf to the checkpoint tensor that fills it.

    shapes: tensor name -> shape as the file stores it ([out, in] for matrices).
    Raises CheckpointError (one line, naming the tensors) for unmapped, unexpected, missing or
    doubly mapped tensors and for shape mismatches.
    """
    ignore = tuple(ignore)
    declared = dict(iter_specs(specs))
    plan: dict[Path, str] = {}
    unmapped, unexpected, doubled, mismatched = [], [], [], []
    for name, shape in shapes.items():
        if keymaps.ignored(ignore, name):
            continue
        path = keymaps.match(keymap, name)
        if path is None:
            unmapped.append(name)
        elif path not in declared:
            unexpected.append(f"{name} (-> {path_str(path)}, which this config does not declare)")
        elif path in plan:
            doubled.append(f"{name} and {plan[path]} (both -> {path_str(path)})")
        else:
            plan[path] = name
            if tuple(shape) != declared[path].shape:
                mismatched.append(f"{name} has shape {tuple(shape)}, expected {declared[path].shape}")
    missing = [f"{_expected_name(keymap, path)} (-> {path_str(path)})" for path in declared if path not in plan]
    problems = [_listing(what, items) for what, items in (
        ("unmapped tensors", unmapped), ("unexpected tensors", unexpected),
        ("tensors mapped twice", doubled), ("missing tensors", missing),
        ("shape mismatches", mismatched)) if items]
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
    return plan


def _expected_name(keymap: dict[str, tuple], path: Path) -> str:
    """The checkpoint name that would fill `path` (for error messages)."""
    for pattern, template in keymap.items():
        if len(template) == len(path) and all(t == p or t == "{i}" for t, p in zip(template, path)):
            layer = next((p for t, p in zip(template, path) if t == "{i}"), None)
            return pattern.replace("{i}", str(layer))
    return "?"


def to_device(array: np.ndarray, dtype: np.dtype, mapped: bool) -> jax.Array:
    """Casts one host tensor and puts it on the device.

    mapped: the array is a view of a memory-mapped file. Then it is copied, because jax may
    alias host memory on CPU and the weights must not keep pointing into the file.
    """
    host = array.astype(dtype, copy=mapped)
    return jax.device_put(host)
