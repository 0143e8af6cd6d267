"""Per-layer model state. The dense family needs paged KV: one page pool per layer.

A page pool is K and V arrays of shape [num_pages, page_size, kv_heads, head_dim]. A sequence
owns a list of pages (its block table); token at position p lives in page
`block_table[p // page_size]`, row `p % page_size`. Pages need not be contiguous or ordered.
Each layer has its own arrays (not one stacked array): an update then touches one buffer in
place, and a decode step never slices (and so copies) a stacked cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PagedKVSpec:
    """What a family needs from the cache: shapes of one layer's K/V pages."""

    num_layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """K and V page pools, one pair per layer: each [num_pages, page_size, kv_heads, head_dim]."""

    k: list[jax.Array]
    v: list[jax.Array]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @staticmethod
    def create(spec: PagedKVSpec, num_pages: int, page_size: int, dtype) -> "PagedKVCache":
        shape = (num_pages, page_size, spec.kv_heads, spec.head_dim)
        return PagedKVCache(
            k=[jnp.zeros(shape, dtype) for _ in range(spec.num_layers)],
            v=[jnp.zeros(shape, dtype) for _ in range(spec.num_layers)],
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionBatch:
    """Where each row's tokens live in the page pool.

    block_tables: int32 [b, max_pages_per_seq], page ids of each row (unused slots: any id).
    Query token (i, j) at position p >= 0 writes its K/V to its page and attends to positions
    0..p of its own row; a position of -1 marks padding, which writes nothing.
    """

    block_tables: jax.Array
