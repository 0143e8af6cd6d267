"""The speculation-width policy as plain Python: every width tried once (widest first), then the
fastest measured, the others retried now and then, each batch-size bucket on its own."""

from weld.engine.spec.policy import WidthPolicy


def test_tries_every_width_then_takes_the_fastest_and_retries_the_others():
    policy = WidthPolicy((0, 1, 3, 7), explore_every=5)
    speed = {0: 100.0, 1: 140.0, 3: 180.0, 7: 120.0}  # tokens per row per second at each width
    first = []
    for _ in range(4):
        width = policy.choose(1)
        first.append(width)
        policy.record(1, width, tokens=int(speed[width]), seconds=1.0)
    assert first == [7, 3, 1, 0]
    later = []
    for _ in range(40):
        width = policy.choose(1)
        later.append(width)
        policy.record(1, width, tokens=int(speed[width]), seconds=1.0)
    assert later.count(3) >= 30 and set(later) == {0, 1, 3, 7}  # mostly the best, all retried
    speed[3] = 50.0  # the text changed: width 3 stopped paying
    for _ in range(60):
        width = policy.choose(1)
        policy.record(1, width, tokens=int(speed[width]), seconds=1.0)
    recent = []
    for _ in range(20):
        recent.append(policy.choose(1))
        policy.record(1, recent[-1], tokens=int(speed[recent[-1]]), seconds=1.0)
    assert max(set(recent), key=recent.count) == 1


def test_batch_buckets_are_measured_apart_and_a_single_width_is_no_choice():
    policy = WidthPolicy((0, 3))
    for rows, width, rate in ((1, 3, 10.0), (1, 0, 5.0), (8, 3, 1.0), (8, 0, 4.0)):
        assert policy.choose(rows) == width
        policy.record(rows, width, tokens=int(rate * rows * 10), seconds=10.0)
    assert policy.choose(1) == 3 and policy.choose(6) == 0  # 6 rows: the bucket of 8
    fixed = WidthPolicy((4,))
    fixed.record(1, 4, 10, 1.0)
    assert fixed.choose(1) == 4 and fixed.rates == {}
