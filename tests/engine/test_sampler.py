"""The device sampler's filters against a plain numpy statement of top-k / top-p / min-p."""

import jax.numpy as jnp
import numpy as np
import pytest

from weld.engine.sampler import SamplingArrays, filter_logits, sample


def reference_keep(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    order = np.argsort(-logits)
    keep = np.zeros_like(logits, bool)
    k = top_k if top_k > 0 else len(logits)
    kept = order[:k]
    p = np.exp(logits[kept] - logits[kept].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    kept = kept[before < top_p]
    keep[kept] = True
    probs = np.exp(logits - logits.max())
    keep &= probs >= min_p  # p / p_max >= min_p
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2),
                                               (8, 0.5, 0.05), (1, 1.0, 0.0)])
def test_filters_match_reference(top_k, top_p, min_p):
    rng = np.random.default_rng(top_k + int(top_p * 10))
    logits = rng.standard_normal((3, 40)).astype(np.float32) * 2
    out = np.asarray(filter_logits(jnp.asarray(logits), jnp.full(3, top_k, jnp.int32), jnp.full(3, top_p),
                                   jnp.full(3, min_p)))
    for row in range(3):
        expect = reference_keep(logits[row], top_k, top_p, min_p)
        np.testing.assert_array_equal(out[row] > -1e29, expect)


def test_filters_on_a_large_vocabulary_from_each_tier():
    """Rows whose cuts lie inside the 256 largest logits and rows whose cuts lie past them (the
    search over the whole row), in one batch: each row keeps what the numpy statement keeps, and
    the same as when it is alone (a row's result depends on its own logits only). top_p is put
    half-way between two tokens' cumulative masses, so the f32 sums cannot tip the boundary."""
    import jax

    from weld.engine.sampler import FILTER_CANDIDATES, _cuts

    v = 12000
    assert FILTER_CANDIDATES < 1000
    rng = np.random.default_rng(3)
    rows, params = [], []
    for scale, top_k, nucleus_at in [(4.0, 0, 100), (0.4, 0, 1000), (0.4, 0, 8000), (0.4, 1000, None),
                                     (0.4, 6000, None), (4.0, 20, None), (0.4, 3000, 2000)]:
        logits = rng.standard_normal(v) * scale
        top_p = 1.0
        if nucleus_at is not None:
            kept = np.sort(logits)[::-1][:top_k or v]
            p = np.exp(kept - kept[0]) / np.exp(kept - kept[0]).sum()
            before = np.cumsum(p) - p
            top_p = (before[nucleus_at - 1] + before[nucleus_at]) / 2  # keeps exactly nucleus_at tokens
        rows.append(logits.astype(np.float32))
        params.append((top_k, np.float32(top_p)))
    logits = np.stack(rows)
    top_k = jnp.asarray([k for k, _ in params], jnp.int32)
    top_p = jnp.asarray([p for _, p in params], jnp.float32)
    out = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p, jnp.zeros(len(rows))))
    for row, (k, p) in enumerate(params):
        expect = reference_keep(logits[row].astype(np.float64), k, float(p), 0.0)
        np.testing.assert_array_equal(out[row] > -1e29, expect, err_msg=f"row {row}")
        alone = filter_logits(jnp.asarray(logits[row:row + 1]), top_k[row:row + 1], top_p[row:row + 1], jnp.zeros(1))
        np.testing.assert_array_equal(np.asarray(alone)[0], out[row])
    assert [int(np.sum(out[r] > -1e29)) for r in (0, 1, 2, 3, 5, 6)] == [100, 1000, 8000, 1000, 20, 2000]
    # and the rows that fit in the first candidates are settled there, the others by the search
    cand = jax.lax.top_k(jnp.asarray(logits), FILTER_CANDIDATES)[0]
    settled = np.asarray(_cuts(jnp.asarray(logits), cand, top_k, top_p)[2]).tolist()
    assert settled == [True, False, False, False, False, True, False]


def test_searched_cuts_equal_the_sorted_ones_with_ties():
    """The search's k-th logit and nucleus threshold are the sorted list's, exactly, on rows of
    many tied values (a top-k cut inside a run of ties counts only part of it), with -inf, -0
    and +0 among them: top_p is put inside a tie group's share of the cumulative mass."""
    from weld.engine.sampler import _cuts, _searched_cuts

    rng = np.random.default_rng(11)
    b, v = 24, 3000
    logits = np.round(rng.standard_normal((b, v)) * 3) / 2  # ~25 distinct values a row
    logits[:, :40] = -np.inf
    logits[::2, 40:60] = -0.0
    logits = logits.astype(np.float32)
    top_k = rng.choice([0, 0, 1, 7, 100, 1000, 2999, 3000, 5000], b)
    top_p = np.ones(b, np.float32)
    for row in range(b):
        k = top_k[row] if 0 < top_k[row] < v else v
        kept = np.sort(logits[row].astype(np.float64))[::-1][:k]
        p = np.exp(kept - kept[0]) / np.exp(kept - kept[0]).sum()
        ends = np.cumsum(p)
        last = np.flatnonzero(np.r_[kept[1:] != kept[:-1], True])  # last index of each tie group
        starts = np.r_[0.0, ends[last[:-1]]]
        groups = np.flatnonzero(ends[last] - starts > 1e-4)  # those of some mass
        if row % 3:  # inside a random group, or the last one (in a top-k cut: the k-th's ties)
            g = groups[-1] if row % 3 == 2 else rng.choice(groups)
            top_p[row] = (starts[g] + ends[last[g]]) / 2  # the threshold is that group's value
    args = jnp.asarray(logits), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p)
    want = _cuts(args[0], -jnp.sort(-args[0], axis=-1), *args[1:])
    got = _searched_cuts(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert np.sum(np.isfinite(np.asarray(want[0]))) >= 8 and np.sum(np.isfinite(np.asarray(want[1]))) >= 8


def arrays(b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0):
    return SamplingArrays(jnp.full(b, temperature, jnp.float32), jnp.full(b, top_k, jnp.int32),
                          jnp.full(b, top_p, jnp.float32), jnp.full(b, min_p, jnp.float32),
                          jnp.zeros(b, jnp.uint32), jnp.full(b, seed, jnp.uint32), jnp.full(b, position, jnp.int32))


def test_greedy_and_seeded_sampling():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
    np.testing.assert_array_equal(sample(logits, arrays(4, temperature=0.0)), np.argmax(logits, -1))
    a = sample(logits, arrays(4, seed=5, position=3))
    b = sample(logits, arrays(4, seed=5, position=3))
    draws = {tuple(np.asarray(sample(logits, arrays(4, seed=s)))) for s in range(8)}
    np.testing.assert_array_equal(a, b)
    assert len(draws) > 1
    # top_k=1 is greedy whatever the seed.
    np.testing.assert_array_equal(sample(logits, arrays(4, top_k=1, seed=9)), np.argmax(logits, -1))


def test_sampling_frequencies_follow_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(probs)[None].repeat(2000, 0), jnp.float32)
    params = SamplingArrays(jnp.ones(2000), jnp.zeros(2000, jnp.int32), jnp.ones(2000), jnp.zeros(2000),
                            jnp.zeros(2000, jnp.uint32), jnp.arange(2000, dtype=jnp.uint32), jnp.zeros(2000, jnp.int32))
    counts = np.bincount(np.asarray(sample(logits, params)), minlength=4) / 2000
    np.testing.assert_allclose(counts, probs, atol=0.04)


def test_penalties_and_bias_change_the_right_logits():
    from weld.engine.sampler import PenaltyArrays, apply_penalties

    logits = jnp.asarray([[2.0, -1.0, 0.5, 3.0, 1.0]])
    pen = PenaltyArrays(presence=jnp.asarray([0.5]), frequency=jnp.asarray([0.25]), repetition=jnp.asarray([2.0]),
                        counts=jnp.asarray([[0, 2, 0, 1, 0]], jnp.int32),
                        prompt_mask=jnp.asarray([[True, False, False, False, False]]),
                        bias_ids=jnp.asarray([[4, -1]], jnp.int32), bias_values=jnp.asarray([[3.0, 9.0]]))
    out = np.asarray(apply_penalties(logits, pen))[0]
    expect = np.array([
        2.0 / 2,                      # in the prompt only: repetition (positive logit divided)
        -1.0 * 2 - 0.25 * 2 - 0.5,    # generated twice: repetition (negative multiplied), frequency, presence
        0.5,                          # untouched
        3.0 / 2 - 0.25 - 0.5,         # generated once
        1.0 + 3.0,                    # logit_bias (the -1 padding entry adds nothing)
    ])
    np.testing.assert_allclose(out, expect, rtol=1e-6)


def exact_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution sampling must follow, stated directly: softmax(logits / T), then keep the
    top-k, then the smallest most-likely set reaching top_p, then tokens with p >= min_p * p_max
    (min-p on the tempered probabilities, as vLLM applies it), renormalized."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(len(p), bool)
    keep[order[:top_k if top_k > 0 else len(p)]] = True
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    before = np.cumsum(q[order]) - q[order]
    nucleus = np.zeros(len(p), bool)
    nucleus[order[before < top_p]] = True
    keep &= nucleus
    keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0)
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.7, 0, 1.0, 0.0),   # temperature alone
    (1.0, 4, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.15),   # each filter
    (1.3, 6, 0.9, 0.05),                                            # all together
])
@pytest.mark.parametrize("vary", ["seed", "position"])
def test_chi_square_against_exact_distribution(temperature, top_k, top_p, min_p, vary):
    """20,000 draws (one per row: distinct seeds, or one seed at distinct positions) against the
    exact distribution. Tokens outside the kept set must never appear; the kept ones must pass a
    chi-square goodness-of-fit test at p > 1e-4 (fixed seeds: the outcome is deterministic)."""
    from scipy.stats import chisquare

    n, v = 20000, 12
    logits = np.random.default_rng(7).standard_normal(v).astype(np.float32) * 1.5
    expect = exact_distribution(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    seeds = np.arange(n, dtype=np.uint32) if vary == "seed" else np.full(n, 12345, np.uint32)
    positions = np.zeros(n, np.int32) if vary == "seed" else np.arange(n, dtype=np.int32)
    params = SamplingArrays(jnp.full(n, temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
                            jnp.full(n, top_p, jnp.float32), jnp.full(n, min_p, jnp.float32),
                            jnp.full(n, 3, jnp.uint32), jnp.asarray(seeds), jnp.asarray(positions))
    draws = np.asarray(sample(jnp.asarray(np.tile(logits, (n, 1))), params))
    counts = np.bincount(draws, minlength=v)
    kept = expect > 0
    assert counts[~kept].sum() == 0, f"filtered tokens were sampled: {counts[~kept]}"
    assert kept.sum() >= 2  # the case is not degenerate
    result = chisquare(counts[kept], n * expect[kept])
    assert result.pvalue > 1e-4, (counts[kept], n * expect[kept])


def test_gumbel_noise_is_finite_at_the_extremes():
    """The extreme uniform bins stay inside (0, 1) in f32: +inf noise would pick a token whatever
    its logit (with 24-bit uniforms the top bin rounded to 1.0, once per 2^24 draws)."""
    from weld.engine.sampler import gumbel_from_bits

    bits = jnp.asarray(np.array([0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1], np.uint32))
    noise = np.asarray(gumbel_from_bits(bits))
    assert np.all(np.isfinite(noise)), noise
    assert np.all(np.diff(noise) >= 0)  # monotone in the bits
