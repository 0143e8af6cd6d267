"""Mixture-of-experts layers against plain numpy statements of their equations: every router,
and the dispatch in both of its forms (a tile per (token, slot) pair at decode sizes, sorted
16-row tiles for prefill)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.models.common import moe as moe_lib
from weld.models.common.spec import random_weights

D = 24


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_route(moe: moe_lib.MoE, logits: np.ndarray, bias: np.ndarray | None):
    """One token at a time, as transformers writes each router."""
    weights, ids = [], []
    for row in logits.astype(np.float64):
        k = moe.top_k
        if moe.router == "softmax_topk":
            p = np_softmax(row)
            idx = np.argsort(-p)[:k]
            w = p[idx] / (p[idx].sum() if moe.norm_topk_prob else 1.0)
        elif moe.router == "topk_softmax":
            z = row + bias
            idx = np.argsort(-z)[:k]
            w = np_softmax(z[idx])
        elif moe.router == "sigmoid_group":
            s = 1 / (1 + np.exp(-row))
            choice = (s + bias).reshape(moe.n_group, -1)
            group_score = np.sort(choice, axis=1)[:, -2:].sum(1)
            keep = np.argsort(-group_score)[:moe.topk_group]
            masked = np.full_like(choice, -np.inf)
            masked[keep] = choice[keep]
            idx = np.argsort(-masked.reshape(-1))[:k]
            w = s[idx]
            if moe.norm_topk_prob:
                w = w / (w.sum() + 1e-20)
            w = w * moe.routed_scaling_factor
        else:  # softmax_group
            p = np_softmax(row)
            groups = p.reshape(moe.n_group, -1)
            keep = np.argsort(-groups.max(1))[:moe.topk_group]
            masked = np.zeros_like(groups)
            masked[keep] = groups[keep]
            idx = np.argsort(-masked.reshape(-1))[:k]
            w = masked.reshape(-1)[idx] * moe.routed_scaling_factor
        weights.append(w)
        ids.append(idx)
    return np.asarray(weights), np.asarray(ids)


ROUTERS = {
    "softmax_topk": moe_lib.MoE(8, 2, 16, router="softmax_topk", norm_topk_prob=False),
    "softmax_topk_norm": moe_lib.MoE(8, 3, 16, router="softmax_topk", norm_topk_prob=True),
    "topk_softmax": moe_lib.MoE(8, 2, 16, router="topk_softmax", router_bias=True),
    "sigmoid_group": moe_lib.MoE(16, 4, 16, router="sigmoid_group", norm_topk_prob=True, routed_scaling_factor=2.5,
                                 n_group=4, topk_group=2, score_bias=True),
    "softmax_group": moe_lib.MoE(16, 3, 16, router="softmax_group", routed_scaling_factor=1.5, n_group=4, topk_group=2),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_routers_match_their_equations(name):
    moe = ROUTERS[name]
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((32, moe.num_experts)).astype(np.float32) * 2
    bias = (rng.standard_normal(moe.num_experts) * 0.5).astype(np.float32) if name in ("topk_softmax", "sigmoid_group") else None
    weights, ids = jax.jit(moe_lib.route, static_argnums=0)(moe, jnp.asarray(logits), None if bias is None else jnp.asarray(bias))
    ref_w, ref_ids = np_route(moe, logits, bias)
    order, ref_order = np.argsort(np.asarray(ids), 1), np.argsort(ref_ids, 1)  # compare as sets per token
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1), np.take_along_axis(ref_ids, ref_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(ref_w, ref_order, 1), rtol=1e-5, atol=1e-6)
    if name == "sigmoid_group":  # the bias chose, but the weights are the unbiased scores
        unbiased, _ = np_route(dataclasses.replace(moe, score_bias=False), logits, np.zeros_like(bias))
        assert not np.allclose(np.sort(ref_w, 1), np.sort(unbiased, 1))


def np_expert(moe, w_gate, w_up, w_down, x, b=None):
    g, u = w_gate @ x, w_up @ x
    if b is not None:
        g, u = g + b[0], u + b[1]
    if moe.activation == "clamped_swiglu":
        g, u = np.minimum(g, moe.swiglu_limit), np.clip(u, -moe.swiglu_limit, moe.swiglu_limit)
        h = (u + 1) * g / (1 + np.exp(-moe.swiglu_alpha * g))
    else:
        h = g / (1 + np.exp(-g)) * u
    return w_down @ h + (0 if b is None else b[2])


@pytest.mark.parametrize("tokens", [1, 9, 40, 200])  # tiles of 1 row (1, 9 tokens), 16 (40), 32 rows (200)
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_experts_match_a_token_by_token_loop(tokens, activation):
    moe = moe_lib.MoE(8, 2, 12, activation=activation, expert_bias=activation == "clamped_swiglu",
                      shared_intermediate_size=0)
    lw = random_weights(moe_lib.moe_specs(moe, D), seed=1, scale=2.0)
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    ids = rng.integers(0, 8, (tokens, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, 7, tokens)) % 8  # distinct experts per token
    w = rng.uniform(0.1, 1, (tokens, 2)).astype(np.float32)
    fused = dict(lw)
    moe_lib.fuse_experts(fused)
    for tree in (lw, fused):  # separate and stacked gate/up
        got = jax.jit(moe_lib.experts, static_argnums=0)(moe, jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), tree)
        a = {k: np.asarray(v) for k, v in lw.items()}
        ref = np.zeros_like(x)
        for n in range(tokens):
            for j in range(2):
                e = ids[n, j]
                b = (a["b_gate"][e], a["b_up"][e], a["b_down"][e]) if moe.expert_bias else None
                ref[n] += w[n, j] * np_expert(moe, a["w_gate"][e], a["w_up"][e], a["w_down"][e], x[n], b)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)


def test_moe_block_adds_the_shared_expert():
    moe = moe_lib.MoE(4, 2, 8, shared_intermediate_size=10)
    lw = random_weights(moe_lib.moe_specs(moe, D), seed=2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, D)), jnp.float32)
    with_shared = moe_lib.moe_block(moe, lw, x)
    routed = moe_lib.moe_block(dataclasses.replace(moe, shared_intermediate_size=0), lw, x)
    s = {k: np.asarray(v) for k, v in lw["shared"].items()}
    xs = np.asarray(x)
    g = xs @ s["w_gate"].T
    shared = ((g / (1 + np.exp(-g))) * (xs @ s["w_up"].T)) @ s["w_down"].T
    np.testing.assert_allclose(np.asarray(with_shared - routed), shared, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change,needle", [
    (dict(top_k=9), "top_k (9) exceeds num_experts (8)"),
    (dict(n_group=3), "multiple of n_group (3)"),
    (dict(router="expert_choice"), "router 'expert_choice'"),
    (dict(router="sigmoid_group", n_group=4, topk_group=1, top_k=3), "hold fewer than top_k (3)"),
])
def test_bad_moe_configs_name_the_value(change, needle):
    with pytest.raises(ValueError, match=None) as err:
        moe_lib.MoE(**{**dict(num_experts=8, top_k=2, intermediate_size=4), **change})
    assert needle in str(err.value)
