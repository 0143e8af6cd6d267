"""Per-layer model state, declared by each family as a `CacheSpec` and created by the engine from it.

Three kinds of per-layer state:
1. paged KV (`PagedKV` -> `KVPages`): K and V pools [num_pages, page_size, kv_heads, head_dim];
2. paged latent (`PagedLatent` -> `LatentPages`, MLA): one pool [num_pages, page_size, 1,
   latent_dim + rope_dim] holding, per token, the normed compressed KV c_kv then the rotated
   shared key k_pe; attention reads it as one key head whose first latent_dim values are also
   the value (absorbed attention), so nothing is expanded per head;
3. per-sequence recurrent state (`Recurrent`, linear attention: a causal-conv window and an f32
   state matrix per sequence). Declared here so that families can state it; the engine does not
   allocate it yet (the hybrid linear-attention issue adds the slot pool).

Paged layers form page groups (`CacheSpec.page_groups`): group 0 holds the layers that see the
whole context (and MLA's latent layers), then one group per sliding window, whose pages are
freed as the window moves on. Each group has a pool and a block table per sequence: token at
position p lives in page `block_table[p // page_size]`, row `p % page_size`, of every layer in
the group. Pages need not be contiguous or ordered. The runner sends one table per row with the
groups side by side ([b, groups * width]); `decoder.Rows.attend` hands each layer its group's.
Each layer has its own arrays (not one stacked array): an update then touches one buffer in
place, and a decode step never slices (and so copies) a stacked cache.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One attention layer's K and V pages. `window`: the layer attends to its last `window`
    positions only (sliding-window attention), None: to all of them."""

    kv_heads: int
    head_dim: int
    window: int | None = None

    def bytes_per_token(self, dtype) -> int:
        return 2 * self.kv_heads * self.head_dim * _itemsize(dtype)

    def create(self, num_pages: int, page_size: int, dtype) -> "KVPages":
        shape = (num_pages, page_size, self.kv_heads, self.head_dim)
        return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@dataclasses.dataclass(frozen=True)
class PagedLatent:
    """One MLA layer's latent pages: c_kv [latent_dim] and k_pe [rope_dim] per token."""

    latent_dim: int
    rope_dim: int
    window: int | None = None

    def bytes_per_token(self, dtype) -> int:
        return (self.latent_dim + self.rope_dim) * _itemsize(dtype)

    def create(self, num_pages: int, page_size: int, dtype) -> "LatentPages":
        return LatentPages(pool=jnp.zeros((num_pages, page_size, 1, self.latent_dim + self.rope_dim), dtype))


@dataclasses.dataclass(frozen=True)
class Recurrent:
    """One linear-attention layer's per-sequence state: the last conv_width - 1 inputs of its causal
    convolution [conv_channels, conv_width - 1] and its state matrix `state_shape`, both f32."""

    conv_channels: int
    conv_width: int
    state_shape: tuple[int, ...]

    def bytes_per_sequence(self) -> int:
        return 4 * (self.conv_channels * (self.conv_width - 1) + math.prod(self.state_shape))


LayerCache = PagedKV | PagedLatent | Recurrent


@dataclasses.dataclass(frozen=True)
class PageGroup:
    """Paged layers that share pages: the same window (None: the whole context)."""

    window: int | None
    layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a model needs from the cache: one entry per layer, in layer order."""

    layers: tuple[LayerCache, ...]

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, (PagedKV, PagedLatent, Recurrent)):
                raise TypeError(f"cache spec layer {i} is a {type(layer).__name__}, not a PagedKV, PagedLatent "
                                "or Recurrent")

    def bytes_per_token(self, dtype, group: int | None = None) -> int:
        """Bytes of page memory one token takes across every paged layer (of one page group)."""
        layers = range(len(self.layers)) if group is None else self.page_groups()[group].layers
        return sum(self.layers[i].bytes_per_token(dtype) for i in layers if not isinstance(self.layers[i], Recurrent))

    def page_groups(self) -> tuple[PageGroup, ...]:
        """Group 0: the paged layers without a window; then one group per distinct window, in
        order of first appearance (a model whose layers all slide has no window-free group)."""
        windows: list[int | None] = []
        for layer in self.layers:
            if not isinstance(layer, Recurrent) and layer.window not in windows:
                windows.append(layer.window)
        windows.sort(key=lambda w: w is not None)  # the full-context group first
        return tuple(PageGroup(w, tuple(i for i, layer in enumerate(self.layers)
                                        if not isinstance(layer, Recurrent) and layer.window == w)) for w in windows)

    def tables(self, block_tables: jax.Array) -> jax.Array:
        """[b, groups * m]: the same page ids [b, m] in every page group's table (a caller that
        gives each sequence the same pages in every group's pool, e.g. a scratch cache)."""
        return jnp.tile(block_tables, (1, len(self.page_groups())))

    def group_of(self, layer: int) -> int:
        return next(g for g, group in enumerate(self.page_groups()) if layer in group.layers)

    def bytes_per_sequence(self) -> int:
        """Bytes of recurrent state one sequence takes across every linear-attention layer."""
        return sum(layer.bytes_per_sequence() for layer in self.layers if isinstance(layer, Recurrent))

    @property
    def has_recurrent(self) -> bool:
        return any(isinstance(layer, Recurrent) for layer in self.layers)

    def create(self, num_pages: int | tuple[int, ...], page_size: int, dtype) -> "Cache":
        """Zeroed page pools for every layer: num_pages pages each, or num_pages[g] for the layers
        of page group g. Raises ValueError for recurrent layers, whose slot pool the engine does
        not have yet."""
        if self.has_recurrent:
            raise ValueError("this model has linear-attention layers (a per-sequence recurrent state), "
                             "which weld's engine does not support yet")
        groups = self.page_groups()
        sizes = (num_pages,) * len(groups) if isinstance(num_pages, int) else tuple(num_pages)
        if len(sizes) != len(groups):
            raise ValueError(f"{len(sizes)} pool sizes for {len(groups)} page groups")
        pages_of = {i: n for group, n in zip(groups, sizes) for i in group.layers}
        return Cache(layers=[layer.create(pages_of[i], page_size, dtype) for i, layer in enumerate(self.layers)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """K and V page pools of one layer, each [num_pages, page_size, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LatentPages:
    """The latent page pool of one MLA layer, [num_pages, page_size, 1, latent_dim + rope_dim]."""

    pool: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """Every layer's state, in layer order (what `forward` takes and returns, donated)."""

    layers: list

    @property
    def num_pages(self) -> int:
        return jax.tree_util.tree_leaves(self.layers[0])[0].shape[0]

    @property
    def page_size(self) -> int:
        return jax.tree_util.tree_leaves(self.layers[0])[0].shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionBatch:
    """Where each row's tokens live in the page pool.

    block_tables: int32 [b, max_pages_per_seq], page ids of each row (unused slots: any id).
    Query token (i, j) at position p >= 0 writes its K/V to its page and attends to positions
    0..p of its own row; a position of -1 marks padding, which writes nothing.
    """

    block_tables: jax.Array
