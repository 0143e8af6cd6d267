"""n-gram prompt lookup: longest suffix match, most recent occurrence, nothing without a match."""

import numpy as np
import pytest

from weld.engine.spec.ngram import NgramProposer, propose_ngram


def brute_force(tokens, k, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_matches_a_brute_force_search_on_random_sequences():
    rng = np.random.default_rng(0)
    found = 0
    for trial in range(300):
        tokens = rng.integers(0, 4 + trial % 6, rng.integers(1, 40)).tolist()
        k, min_n, max_n = int(rng.integers(1, 6)), int(rng.integers(1, 3)), int(rng.integers(2, 5))
        expect = brute_force(tokens, k, min_n, max(min_n, max_n))
        assert propose_ngram(tokens, k, min_n, max(min_n, max_n)) == expect, (tokens, k, min_n, max_n)
        found += bool(expect)
    assert 50 < found < 300  # both outcomes were exercised


def test_prefers_the_longest_suffix_match_over_a_more_recent_shorter_one():
    rng = np.random.default_rng(1)
    a, b, c = rng.choice(np.arange(100, 200), 3, replace=False).tolist()
    long_follow = rng.integers(300, 400, 4).tolist()
    short_follow = rng.integers(500, 600, 4).tolist()
    # [a b c] + long_follow early; a later lone c (1-gram) followed by short_follow; ends with a b c.
    tokens = [a, b, c] + long_follow + [7, c] + short_follow + [8, a, b, c]
    assert propose_ngram(tokens, k=4, min_n=1, max_n=3) == long_follow
    assert propose_ngram(tokens, k=4, min_n=1, max_n=1) == short_follow  # only 1-grams: most recent c
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == long_follow[:2]


def test_proposes_nothing_without_a_match():
    tokens = np.random.default_rng(2).permutation(50).tolist()  # no token repeats
    assert propose_ngram(tokens, k=3, min_n=1, max_n=3) == []
    repeated_once = tokens + tokens[10:12]  # a 2-gram repeat, but min_n = 3 asks for more
    assert propose_ngram(repeated_once, k=3, min_n=3, max_n=4) == []
    assert propose_ngram(repeated_once, k=3, min_n=2, max_n=4) == tokens[12:15]
    assert propose_ngram([], k=3) == [] and propose_ngram([5], k=3) == []


def test_batch_pads_with_minus_one_and_validates():
    proposer = NgramProposer(k=3, min_n=1, max_n=2)
    drafts, num = proposer.propose_batch([[1, 2, 3, 1, 2], [9, 8, 7], [4, 4]])
    np.testing.assert_array_equal(num, [3, 0, 1])
    np.testing.assert_array_equal(drafts, [[3, 1, 2], [-1, -1, -1], [4, -1, -1]])
    for bad in (dict(k=0), dict(min_n=0), dict(min_n=3, max_n=2)):
        with pytest.raises(ValueError):
            NgramProposer(**bad)


def test_device_lookup_matches_the_host_rule_on_a_batch():
    """`lookup` (jnp, one batch of histories padded with junk past each length) drafts what
    `propose_ngram` drafts for each row alone, for several lookup windows."""
    import jax

    from weld.engine.spec.ngram import lookup

    rng = np.random.default_rng(3)
    for k, min_n, max_n in ((4, 1, 3), (1, 2, 2), (7, 1, 5)):
        rows = [rng.integers(0, 3 + i % 5, rng.integers(1, 60)).tolist() for i in range(24)]
        width = 64
        history = rng.integers(0, 8, (len(rows), width)).astype(np.int32)  # junk past each length
        for i, tokens in enumerate(rows):
            history[i, :len(tokens)] = tokens
        lengths = np.asarray([len(t) for t in rows], np.int32)
        drafts, num = jax.jit(lookup, static_argnums=(2, 3, 4))(history, lengths, k, min_n, max_n)
        drafts, num = np.asarray(drafts), np.asarray(num)
        found = 0
        for i, tokens in enumerate(rows):
            expect = propose_ngram(tokens, k, min_n, max_n)
            assert drafts[i, :num[i]].tolist() == expect, (tokens, k, min_n, max_n)
            found += bool(expect)
        assert 0 < found < len(rows)
