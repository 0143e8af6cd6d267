"""The serving side of the DSpark drafter: a block reads the context's pages and writes none."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from weld.engine.spec import dspark
from weld.engine.spec.drafters import DSparkDrafter
from weld.models import llama
from weld.models.common.attention import write_pages
from weld.models.common.spec import random_weights

TARGET = llama.Config(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8)
PAGE, PAGES = 4, 24


def test_a_write_of_no_tokens_returns_the_pool_itself():
    pool = jnp.arange(PAGES * PAGE * 6, dtype=jnp.float32).reshape(PAGES, PAGE, 6)
    tables = jnp.zeros((2, 3), jnp.int32)
    assert write_pages(pool, jnp.zeros((2, 0, 2, 3)), jnp.zeros((2, 0), jnp.int32), tables) is pool


def test_propose_reads_the_context_pages_and_writes_none():
    """The compiled block has no scatter into the drafter's pools (it once scattered its slots at
    position -1 into every pool: nothing written, a pass over the pool all the same), and the
    state it returns is the state it was given."""
    cfg = dspark.DraftConfig.for_target(TARGET, block_size=3, target_layers=(0, 2), num_heads=4, num_kv_heads=2,
                                        head_dim=8, intermediate_size=32, markov_rank=4, num_layers=2)
    weights = random_weights(llama.weight_specs(TARGET), seed=0)
    params = dspark.init_params(cfg, seed=1, target_weights=weights)
    drafter = DSparkDrafter(cfg, threshold=0.0)
    state = drafter.cache_spec().create(PAGES, PAGE, jnp.float32)
    pool_shape = state.layers[0].k.shape
    tables = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4))
    args = (jnp.asarray([5, 9], jnp.int32), jnp.asarray([6, 3], jnp.int32), tables, jnp.asarray([4, 4], jnp.int32))

    def propose(state, last, positions, tables, budget):
        return drafter.propose(params, state, weights, last, positions, tables, budget, cfg.block_size)

    hlo = jax.jit(propose).lower(state, *args).compile().as_text()
    pool_type = "f32[" + ",".join(map(str, pool_shape)) + "]"
    writes = [line for line in hlo.splitlines() if re.search(re.escape(pool_type) + r"\{[^}]*\} scatter\(", line)]
    assert not writes, writes[:2]
    out_state, drafts, num = propose(state, *args)
    assert all(a is b for a, b in zip(jax.tree.leaves(out_state), jax.tree.leaves(state)))
    assert drafts.shape == (2, cfg.block_size) and np.asarray(num).tolist() == [3, 3]  # threshold 0: all sent
