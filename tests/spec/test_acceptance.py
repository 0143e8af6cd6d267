"""Acceptance of drafts: greedy prefix logic against a Python loop, and rejection sampling
reproducing the target's distribution (chi-square over many seeded draws)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from weld.engine.sampler import SamplingArrays, sample
from weld.engine.spec.acceptance import draft_sample, greedy_accept, rejection_accept

V, K = 6, 3
_accept = jax.jit(rejection_accept)


def params_for(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed_offset=0):
    """n rows, each with its own seed and position: one row is one independent draw."""
    rows = np.arange(n)
    return SamplingArrays(jnp.full(n, temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
                          jnp.full(n, top_p, jnp.float32), jnp.full(n, min_p, jnp.float32),
                          jnp.asarray(rows // 7 + seed_offset, jnp.uint32), jnp.asarray(rows * 31 + 5, jnp.uint32),
                          jnp.asarray(rows % 997, jnp.int32))


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """A plain numpy statement of the distribution plain sampling draws from."""
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(len(p), bool)
    kept = order[:top_k] if top_k > 0 else order
    mass = p[kept] / p[kept].sum()
    keep[kept[(np.cumsum(mass) - mass) < top_p]] = True
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def check_distribution(observed_tokens, expected, label):
    counts = np.bincount(observed_tokens, minlength=len(expected))
    assert counts[expected == 0].sum() == 0, f"{label}: drew tokens of probability 0: {counts}"
    support = expected > 0
    result = stats.chisquare(counts[support], expected[support] / expected[support].sum() * counts.sum())
    assert result.pvalue > 1e-4, f"{label}: counts {counts} vs expected {np.round(expected * counts.sum())}"


def run_and_check(target_logits, draft_probs, ref_kwargs, n, rng, deterministic):
    """Drafts per row are drawn from draft_probs (numpy); deterministic: the rule is told they are
    fixed (q one-hot), which must hold for any drafts, so also for these. (Uniform drafts would hide
    a residual that keeps d: its excess mass on d then averages out exactly.)"""
    drafts = np.stack([rng.choice(V, size=n, p=draft_probs[j]) for j in range(K)], axis=1)
    num_drafts = rng.integers(0, K + 1, size=n)
    logits = jnp.asarray(np.broadcast_to(target_logits, (n, K + 1, V)), jnp.float32)
    q = None if deterministic else jnp.asarray(np.broadcast_to(draft_probs, (n, K, V)), jnp.float32)
    num_accepted, tokens = map(np.asarray, _accept(logits, jnp.asarray(drafts, jnp.int32),
                                                   jnp.asarray(num_drafts, jnp.int32),
                                                   params_for(n, **ref_kwargs), q))
    assert np.all(num_accepted <= num_drafts)
    # Emitted: the accepted drafts, then exactly one more token, then padding.
    for j in range(K + 1):
        emitted = num_accepted >= j
        assert np.all(tokens[emitted, j] >= 0) and np.all(tokens[~emitted, j] == -1)
        if j == K:
            continue
        accepted_here = num_accepted > j
        np.testing.assert_array_equal(tokens[accepted_here, j], drafts[accepted_here, j])
    # Both outcomes happen often enough for the test to mean something.
    first_sent = num_drafts > 0
    rate = np.mean(num_accepted[first_sent] > 0)
    assert 0.1 < rate < 0.9, rate
    # The token at slot j (emitted when the first j drafts were accepted) follows p_j.
    for j in range(K + 1):
        expected = reference_probs(target_logits[j], **ref_kwargs)
        check_distribution(tokens[num_accepted >= j, j], expected, f"slot {j}")


def toy(seed, agreement=-0.8):
    """Target logits [K+1, V] and a draft distribution [K, V] that (agreement < 0) favours what
    the target does not."""
    rng = np.random.default_rng(seed)
    target = rng.standard_normal((K + 1, V)) * 1.5
    q = np.exp(agreement * target[:K] + rng.standard_normal((K, V)))
    return rng, target, q / q.sum(-1, keepdims=True)


def test_rejection_sampling_with_a_disagreeing_draft_keeps_the_target_distribution():
    rng, target, q = toy(0)
    run_and_check(target, q, {}, 40000, rng, deterministic=False)


def test_rejection_sampling_with_a_deterministic_draft_keeps_the_target_distribution():
    rng, target, q = toy(1, agreement=0.5)
    run_and_check(target, q, {}, 40000, rng, deterministic=True)


def test_rejection_sampling_applies_temperature_and_filters_like_the_sampler():
    rng, target, q = toy(2, agreement=0.5)  # q also proposes tokens the filters remove (p = 0)
    kwargs = dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)
    assert (reference_probs(target[0], **kwargs) == 0).any()  # the filters matter here
    run_and_check(target, q, kwargs, 40000, rng, deterministic=False)


# The statistical tests' deterministic case's shapes (and None passed the same way): its program again.
N_SMALL = 40000


def test_no_drafts_is_plain_sampling_bit_for_bit():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((N_SMALL, K + 1, V)) * 2, jnp.float32)
    drafts = jnp.asarray(rng.integers(0, V, (N_SMALL, K)), jnp.int32)
    for kwargs in ({}, dict(temperature=0.8, top_k=4, top_p=0.9)):
        params = params_for(N_SMALL, **kwargs)
        num_accepted, tokens = _accept(logits, drafts, jnp.zeros(N_SMALL, jnp.int32), params, None)
        np.testing.assert_array_equal(num_accepted, 0)
        np.testing.assert_array_equal(tokens[:, 0], jax.jit(sample)(logits[:, 0], params))


def test_rows_do_not_depend_on_batch_neighbours_and_greedy_rows_verify_greedily():
    rng = np.random.default_rng(4)
    n = N_SMALL
    logits = rng.standard_normal((n, K + 1, V)).astype(np.float32)
    drafts = (logits[:, :K].argmax(-1) * (rng.random((n, K)) < 0.7)).astype(np.int32)
    num_drafts = np.full(n, K, np.int32)
    params = params_for(n)
    params.temperature = params.temperature.at[::3].set(0.0)
    full = _accept(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_drafts), params, None)
    # The same rows in another order, next to other rows: each row's result is unchanged.
    order = rng.permutation(n)
    mixed_logits, mixed_drafts = logits[order].copy(), drafts[order].copy()
    neighbours = order % 2 == 0  # rows whose neighbours' data is replaced
    mixed_logits[~neighbours] = rng.standard_normal(mixed_logits[~neighbours].shape)
    mixed_drafts[~neighbours] = rng.integers(0, V, mixed_drafts[~neighbours].shape)
    mixed = _accept(jnp.asarray(mixed_logits), jnp.asarray(mixed_drafts), jnp.asarray(num_drafts),
                    jax.tree.map(lambda x: x[order], params), None)
    np.testing.assert_array_equal(np.asarray(mixed[1])[neighbours], np.asarray(full[1])[order][neighbours])
    greedy = greedy_accept(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_drafts))
    np.testing.assert_array_equal(full[1][::3], greedy[1][::3])
    assert not np.array_equal(full[1], greedy[1])  # the sampled rows did sample


def test_greedy_acceptance_matches_a_python_loop():
    rng = np.random.default_rng(5)
    b, k, v = 200, 5, 40
    logits = rng.standard_normal((b, k + 1, v)).astype(np.float32)
    argmax = logits.argmax(-1)
    num_drafts = rng.integers(0, k + 1, b)
    mismatch_at = rng.integers(0, k + 1, b)  # drafts agree with the target before this slot
    drafts = rng.integers(0, v, (b, k))
    for i in range(b):
        drafts[i, :mismatch_at[i]] = argmax[i, :mismatch_at[i]]
        if mismatch_at[i] < k:
            drafts[i, mismatch_at[i]] = (argmax[i, mismatch_at[i]] + 1 + rng.integers(0, v - 1)) % v
        drafts[i, num_drafts[i]:] = -1
    num_accepted, tokens = map(np.asarray, greedy_accept(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
                                                         jnp.asarray(num_drafts, jnp.int32)))
    for i in range(b):
        accepted = 0
        while accepted < num_drafts[i] and drafts[i, accepted] == argmax[i, accepted]:
            accepted += 1
        expect = list(drafts[i, :accepted]) + [argmax[i, accepted]] + [-1] * (k - accepted)
        assert num_accepted[i] == accepted
        np.testing.assert_array_equal(tokens[i], expect)
    assert len(set(num_accepted.tolist())) == k + 1  # every acceptance length occurred


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_sample_draws_from_the_returned_distribution(temperature):
    rng = np.random.default_rng(6)
    n = 20000
    logits = rng.standard_normal(V) * 1.5
    params = params_for(n, temperature=temperature)
    tokens, q = jax.jit(draft_sample)(jnp.asarray(np.broadcast_to(logits, (n, V)), jnp.float32), params)
    tokens = np.asarray(tokens)
    if temperature == 0.0:
        np.testing.assert_array_equal(tokens, logits.argmax())
        return
    np.testing.assert_allclose(np.asarray(q[0]), reference_probs(logits), rtol=1e-5)
    check_distribution(tokens, reference_probs(logits), "draft")
    # Its noise is not the target's: the same (seed, position) picks differently from `sample`.
    target_draw = np.asarray(sample(jnp.asarray(np.broadcast_to(logits, (n, V)), jnp.float32), params))
    assert np.mean(target_draw == tokens) < 0.6


def test_coupled_acceptance_emits_the_plain_draws_and_accepts_a_draft_with_its_probability():
    """coupled_accept: every emitted token is what `sample` draws at that slot's position (so
    speculation never changes a seeded output), the accepted drafts are the leading ones equal
    to those draws, and a deterministic draft is accepted with probability p(draft)."""
    from weld.engine.spec.acceptance import coupled_accept

    n = 4000
    rng = np.random.default_rng(11)
    logits = jnp.asarray(np.tile(rng.standard_normal((1, K + 1, V)) * 1.5, (n, 1, 1)), jnp.float32)
    drafts = jnp.asarray(np.tile(rng.integers(0, V, (1, K)), (n, 1)), jnp.int32)
    num_drafts = jnp.asarray(rng.integers(0, K + 1, n), jnp.int32)
    params = params_for(n, temperature=0.9, top_k=5)
    accepted, tokens = jax.jit(coupled_accept)(logits, drafts, num_drafts, params)
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)
    for j in range(K + 1):  # slot j's draw, as plain sampling at position + j
        draws = np.asarray(sample(logits[:, j], SamplingArrays(params.temperature, params.top_k, params.top_p,
                                                               params.min_p, params.seed_hi, params.seed_lo,
                                                               params.position + j)))
        emitted = accepted >= j
        np.testing.assert_array_equal(tokens[emitted, j], draws[emitted])
        assert np.all(tokens[~emitted, j] == -1)
        if j < K:  # a sent draft at j is accepted iff the ones before were and it equals the draw
            sent = (num_drafts > j) & (accepted >= j)
            np.testing.assert_array_equal(accepted[sent] > j, draws[sent] == np.asarray(drafts)[sent, j])
    p0 = reference_probs(np.asarray(logits[0, 0]), temperature=0.9, top_k=5)[int(drafts[0, 0])]
    sent0 = np.asarray(num_drafts) > 0
    rate = np.mean(accepted[sent0] > 0)
    assert abs(rate - p0) < 4 * np.sqrt(p0 * (1 - p0) / sent0.sum()) + 1e-9, (rate, p0)
    greedy = params_for(n, temperature=0.0)
    accepted, tokens = jax.jit(coupled_accept)(logits, drafts, num_drafts, greedy)
    expect_accepted, expect_tokens = greedy_accept(logits, drafts, num_drafts)
    np.testing.assert_array_equal(accepted, expect_accepted)
    np.testing.assert_array_equal(tokens, expect_tokens)
