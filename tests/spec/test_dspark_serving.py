"""The serving side of the DSpark drafter: a block reads the context's pages and writes none."""

from __future__ import annotations

import dataclasses
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


def test_a_call_of_width_k_drafts_as_a_drafter_with_a_block_of_k():
    """propose(k) builds a block of the anchor and k slots (not the drafter's whole block): its
    drafts and the number sent are those of the dense reference drafter with block_size = k, on
    the context that `observe` paged (rows with different contexts and anchors)."""
    cfg = dspark.DraftConfig.for_target(TARGET, block_size=5, target_layers=(0, 2), num_heads=4, num_kv_heads=2,
                                        head_dim=8, intermediate_size=32, markov_rank=4, num_layers=2)
    weights = random_weights(llama.weight_specs(TARGET), seed=0)
    params = dspark.init_params(cfg, seed=1, target_weights=weights)
    rng = np.random.default_rng(3)  # a Markov bias and confidence that are not zero: every term counts
    params["markov_out"] = params["markov_out"] + 0.3 * rng.standard_normal(params["markov_out"].shape)
    params["confidence"] = params["confidence"] + 0.5 * rng.standard_normal(params["confidence"].shape)
    drafter = DSparkDrafter(cfg, threshold=0.2)
    lengths = np.array([9, 5])  # context tokens per row; the anchor sits at that position
    b, width = 2, len(cfg.target_layers) * cfg.hidden_size
    features = jnp.asarray(rng.standard_normal((b, 12, width)), jnp.float32)
    positions = np.where(np.arange(12)[None] < lengths[:, None], np.arange(12)[None], -1).astype(np.int32)
    tables = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4))
    state = drafter.observe(params, drafter.cache_spec().create(PAGES, PAGE, jnp.float32), (None,),
                            (jnp.asarray(positions),), (tables,), None, (features,))
    anchors = jnp.asarray([5, 9], jnp.int32)
    context = dspark.project_context(params, cfg, features)
    ctx_kv = dspark.context_kv(params, cfg, context, jnp.maximum(jnp.asarray(positions), 0))
    sent = []
    for k in (1, 2, 5):
        _, drafts, num = jax.jit(lambda st, k=k: drafter.propose(params, st, weights, anchors, jnp.asarray(lengths),
                                                                 tables, jnp.asarray([8, 8]), k))(state)
        dense = dspark.propose(params, dataclasses.replace(cfg, block_size=k), weights, ctx_kv,
                               jnp.asarray(positions), anchors, jnp.asarray(lengths), threshold=0.2)
        assert np.asarray(num).tolist() == np.asarray(dense.num_drafts).tolist()
        assert np.asarray(drafts).tolist() == np.asarray(dense.tokens).tolist()
        sent += np.asarray(num).tolist()
    assert max(sent) > 1 and min(sent) < max(sent)  # the threshold cut some blocks short, not all
