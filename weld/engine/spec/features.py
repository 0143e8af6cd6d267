"""What a drafter reads from the target: the residual stream after chosen layers.

For every token the target processes, x_l [d] = the residual stream after layer l (the input of
layer l+1, before any norm), for each l in the drafter's `target_layers`, concatenated in that
order -> [t, n * d]. Serving gets it from the family's own paged `forward` (`capture_layers`);
training runs the same forward over whole sequences here, on a scratch cache, so there is no
second copy of any family's block.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from weld.models.common.cache import AttentionBatch

PAGE = 16  # page size of the scratch cache


def target_hidden_states(family: ModuleType, weights: dict, cfg: Any, tokens: jax.Array,
                         layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The target over whole sequences tokens int32 [b, t] (positions 0..t-1; right padding is
    harmless under the causal mask), through `family.forward` on a fresh paged cache.

    Returns (selected [b, t, len(layers) * d]: the residual stream after each layer in `layers`,
    concatenated; final [b, t, d]: the final-normed hidden states, whose LM head gives the logits).
    """
    b, t = tokens.shape
    pages = -(-t // PAGE)
    spec = family.cache_spec(cfg)
    cache = spec.create(b * pages, PAGE, weights["final_norm"].dtype)
    tables = spec.tables(jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, states, _ = family.forward(weights, cfg, tokens, positions, cache, AttentionBatch(tables),
                                  jnp.zeros((b, 1), jnp.int32), capture_layers=tuple(layers) + (cfg.num_layers,))
    d = cfg.hidden_size
    return states[..., :-d], states[..., -d:]
