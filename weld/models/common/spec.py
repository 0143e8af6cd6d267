"""Weights declared once: shape and logical axes per leaf.

Loading, random init for tests, quantization and sharding all derive from one declaration
(`weight_specs(cfg)` of a model family), a nested dict whose leaves are `WeightSpec`s and
whose lists hold per-layer dicts (per-layer buffers: slicing stacked layers copies weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One weight: its shape, the logical name of each axis, how to initialise it at random, and
    whether `--quantization` quantizes it (`quant.leaf_mode`): "linear" for matrices run through
    `layers.linear`, "expert" for an MoE layer's expert stacks (a mix may give them fewer bits),
    "head" for the LM head (or the tied
    embedding serving as one), which keeps 8 bits; None for everything else (norms, biases,
    routers, an untied embedding that only serves lookups)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" (scaled by fan-in), "ones" (norm scales), "zeros" (biases)
    quantize: str | None = None  # "linear" | "expert" | "head" | None

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")
        if self.quantize not in (None, "linear", "expert", "head"):
            raise ValueError(f"quantize must be 'linear', 'head' or None, got {self.quantize!r}")


Path = tuple[Any, ...]


def iter_specs(tree: Any, prefix: Path = ()) -> Iterator[tuple[Path, WeightSpec]]:
    """Yields (path, spec) for every leaf; a path is a tuple of dict keys and list indices."""
    if isinstance(tree, WeightSpec):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, sub in tree.items():
            yield from iter_specs(sub, prefix + (key,))
    elif isinstance(tree, (list, tuple)):
        for i, sub in enumerate(tree):
            yield from iter_specs(sub, prefix + (i,))
    else:
        raise TypeError(f"unexpected node {type(tree).__name__} at {path_str(prefix)}")


def path_str(path: Path) -> str:
    return ".".join(str(p) for p in path)


def map_specs(fn: Callable[[Path, WeightSpec], Any], tree: Any, prefix: Path = ()) -> Any:
    """Builds a tree of the same structure with fn(path, spec) at each leaf."""
    if isinstance(tree, WeightSpec):
        return fn(prefix, tree)
    if isinstance(tree, dict):
        return {k: map_specs(fn, v, prefix + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [map_specs(fn, v, prefix + (i,)) for i, v in enumerate(tree)]
    raise TypeError(f"unexpected node {type(tree).__name__} at {path_str(prefix)}")


def set_path(tree: dict, path: Path, value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def abstract_weights(specs: Any, dtype: Any) -> Any:
    """The tree of `jax.ShapeDtypeStruct`s that loaded weights will have."""
    return map_specs(lambda _, s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), specs)


def random_weights(specs: Any, seed: int = 0, dtype: Any = jnp.float32, scale: float = 1.0) -> Any:
    """Random weights for tests. Norm scales and biases are perturbed too, so they can't hide bugs."""
    rng = np.random.default_rng(seed)

    def init(_, spec: WeightSpec):
        if spec.init == "ones":
            x = 1.0 + 0.1 * rng.standard_normal(spec.shape)
        elif spec.init == "zeros":
            x = 0.1 * rng.standard_normal(spec.shape)
        else:
            fan_in = spec.shape[-1] if len(spec.shape) > 1 else 1
            x = scale * rng.standard_normal(spec.shape) / np.sqrt(fan_in)
        return jnp.asarray(x, dtype=dtype)

    return map_specs(init, specs)
