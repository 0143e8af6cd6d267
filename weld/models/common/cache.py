"""Per-layer model state, declared by each family as a `CacheSpec` and created by the engine from it.

Three kinds of per-layer state:
1. paged KV (`PagedKV` -> `KVPages`): K and V pools [num_pages, page_size, kv_heads x head_dim]
   (a token's heads side by side in one row);
2. paged latent (`PagedLatent` -> `LatentPages`, MLA): one pool [num_pages, page_size,
   latent_dim + rope_dim] holding, per token, the normed compressed KV c_kv then the rotated
   shared key k_pe; attention reads it as one key head whose first latent_dim values are also
   the value (absorbed attention), so nothing is expanded per head;
3. per-sequence recurrent state (`Recurrent` -> `RecurrentState`, linear attention): a slot pool
   per layer, conv [num_slots, channels, conv_width - 1] (the last inputs of the causal conv) and
   state [num_slots, *state_shape], both f32. A sequence owns one slot (the block manager hands
   it out, `AttentionBatch.state_slots` says which row uses which); prefix-cache snapshots and
   speculative roll-back copy whole slots (`Cache.copy_slots`, `take_slots` / `put_slots`).

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
from typing import Any

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

    def page_shapes(self, page_size: int) -> tuple[tuple[int, ...], ...]:
        """One page of each pool (K, V): a row per token, its KV heads side by side."""
        return ((page_size, self.kv_heads * self.head_dim),) * 2

    def create(self, num_pages: int, page_size: int, dtype) -> "KVPages":
        shape = (num_pages, page_size, self.kv_heads * self.head_dim)
        return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), kv_heads=self.kv_heads)


@dataclasses.dataclass(frozen=True)
class PagedLatent:
    """One MLA layer's latent pages: c_kv [latent_dim] and k_pe [rope_dim] per token."""

    latent_dim: int
    rope_dim: int
    window: int | None = None

    def bytes_per_token(self, dtype) -> int:
        return (self.latent_dim + self.rope_dim) * _itemsize(dtype)

    def page_shapes(self, page_size: int) -> tuple[tuple[int, ...], ...]:
        return ((page_size, self.latent_dim + self.rope_dim),)

    def create(self, num_pages: int, page_size: int, dtype) -> "LatentPages":
        return LatentPages(pool=jnp.zeros((num_pages, page_size, self.latent_dim + self.rope_dim), dtype))


@dataclasses.dataclass(frozen=True)
class Recurrent:
    """One linear-attention layer's per-sequence state: the last conv_width - 1 inputs of its causal
    convolution [conv_channels, conv_width - 1] and its state matrix `state_shape`, both f32."""

    conv_channels: int
    conv_width: int
    state_shape: tuple[int, ...]

    def bytes_per_sequence(self) -> int:
        return 4 * (self.conv_channels * (self.conv_width - 1) + math.prod(self.state_shape))

    def create(self, num_slots: int) -> "RecurrentState":
        return RecurrentState(conv=jnp.zeros((num_slots, self.conv_channels, self.conv_width - 1), jnp.float32),
                              state=jnp.zeros((num_slots,) + tuple(self.state_shape), jnp.float32))


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

    def page_bytes(self, dtype, page_size: int, group: int | None = None, measure: Any = None) -> int:
        """Device bytes of one page across every paged layer (of one page group): each pool's
        page as measure(shape, dtype, heads) gives it (`sharding.page_bytes`: the tile padding
        of row-major pools on a TPU, each KV-head shard's over a mesh), else its logical size."""
        layers = range(len(self.layers)) if group is None else self.page_groups()[group].layers
        if measure is None:
            return page_size * self.bytes_per_token(dtype, group)
        return sum(measure(shape, dtype, getattr(self.layers[i], "kv_heads", 1)) for i in layers
                   if not isinstance(self.layers[i], Recurrent) for shape in self.layers[i].page_shapes(page_size))

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

    def create(self, num_pages: int | tuple[int, ...], page_size: int, dtype, num_slots: int = 0) -> "Cache":
        """Zeroed page pools for every paged layer: num_pages pages each, or num_pages[g] for the
        layers of page group g; and num_slots recurrent-state slots for every linear-attention
        layer (a model with such layers needs at least one)."""
        if self.has_recurrent and num_slots < 1:
            raise ValueError("this model has linear-attention layers: its cache needs recurrent-state slots "
                             f"(num_slots >= 1, got {num_slots})")
        groups = self.page_groups()
        sizes = (num_pages,) * len(groups) if isinstance(num_pages, int) else tuple(num_pages)
        if len(sizes) != len(groups):
            raise ValueError(f"{len(sizes)} pool sizes for {len(groups)} page groups")
        pages_of = {i: n for group, n in zip(groups, sizes) for i in group.layers}
        return Cache(layers=[layer.create(num_slots) if isinstance(layer, Recurrent)
                             else layer.create(pages_of[i], page_size, dtype) for i, layer in enumerate(self.layers)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """K and V page pools of one layer, each [num_pages, page_size, kv_heads x head_dim]: one row
    per token, its KV heads side by side (lane-dense on a TPU: a page of SmolLM2's 3 heads of 64
    is [16, 192], where [16, 3, 64] pads each token's heads to a (4, 128) tile; the megakernel
    scores every head against a tile of such rows in one product). `kv_heads` (static) splits a
    row into its heads."""

    k: jax.Array
    v: jax.Array
    kv_heads: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LatentPages:
    """The latent page pool of one MLA layer, [num_pages, page_size, latent_dim + rope_dim]."""

    pool: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RecurrentState:
    """The state slots of one linear-attention layer: conv [slots, channels, conv_width - 1] (the
    causal conv's last inputs, oldest first) and state [slots, *state_shape], both f32."""

    conv: jax.Array
    state: jax.Array


def _paged(layer) -> bool:
    return not isinstance(layer, RecurrentState)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """Every layer's state, in layer order (what `forward` takes and returns, donated)."""

    layers: list

    @property
    def num_pages(self) -> int:
        return jax.tree_util.tree_leaves(next(x for x in self.layers if _paged(x)))[0].shape[0]

    @property
    def page_size(self) -> int:
        return jax.tree_util.tree_leaves(next(x for x in self.layers if _paged(x)))[0].shape[1]

    @property
    def num_slots(self) -> int:
        """Recurrent-state slots per linear-attention layer (0: the model has none)."""
        return next((x.conv.shape[0] for x in self.layers if not _paged(x)), 0)

    def take_slots(self, slots: jax.Array) -> list:
        """The recurrent states of slots [n] (every linear-attention layer's, in layer order; a
        slot < 0 reads zeros): what `put_slots` writes back."""
        return [jax.tree_util.tree_map(lambda a: gather_slots(a, slots), x) for x in self.layers if not _paged(x)]

    def put_slots(self, saved: list, slots: jax.Array) -> "Cache":
        """Writes `take_slots`' states back into slots [n] (a slot < 0 writes nothing)."""
        it = iter(saved)
        return Cache(layers=[x if _paged(x) else jax.tree_util.tree_map(lambda a, v: scatter_slots(a, slots, v), x, next(it))
                             for x in self.layers])

    def copy_slots(self, src: jax.Array, dst: jax.Array) -> "Cache":
        """Copies the recurrent state of slot src[i] into slot dst[i] (pairs with a negative id
        copy nothing); every source is read before any destination is written."""
        return self.put_slots(self.take_slots(src), jnp.where(src < 0, -1, dst))


def gather_slots(a: jax.Array, slots: jax.Array) -> jax.Array:
    """Rows slots [n] of a slot pool a [num_slots, ...]; zeros where a slot is < 0."""
    rows = jnp.take(a, jnp.maximum(slots, 0), axis=0)
    return jnp.where((slots >= 0).reshape((-1,) + (1,) * (a.ndim - 1)), rows, 0)


def scatter_slots(a: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """a with values[i] written to slot slots[i] (nothing where it is < 0)."""
    return a.at[jnp.where(slots < 0, a.shape[0], slots)].set(values.astype(a.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionBatch:
    """Where each row's tokens live in the page pool.

    block_tables: int32 [b, max_pages_per_seq], page ids of each row (unused slots: any id).
    Query token (i, j) at position p >= 0 writes its K/V to its page and attends to positions
    0..p of its own row; a position of -1 marks padding, which writes nothing.
    state_slots: int32 [b], the recurrent-state slot of each row (-1: none; the row's recurrent
    state is neither read nor written). None: row i uses slot i. A row whose first position is 0
    starts from a zero state; any other row continues its slot's state.
    In a grouped (mixed) forward both are tuples with one entry per row group.
    """

    block_tables: Any
    state_slots: Any = None
