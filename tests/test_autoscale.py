"""The "auto" parallelism policy (dstl.spark.autoscale), without Spark: it grows when batches take
longer than the target, shrinks when they take far less, stays in between, respects its bounds and
waits a window after each change (no flapping)."""
from __future__ import annotations

import pytest

from dstl.spark.autoscale import AutoscalePolicy


def feed(policy, p, times):
    """The parallelism after each batch time in `times`, rescaling as the policy says."""
    seen = []
    for t in times:
        nxt = policy.observe(p, t)
        p = nxt
        seen.append(p)
    return seen


def test_grows_to_bring_batch_time_to_the_aim():
    pol = AutoscalePolicy(1, 8, target_seconds=10.0)
    # median 12 s at P=2: 2 * 12 / 5 = 4.8 -> 5
    assert feed(pol, 2, [12, 12, 12]) == [2, 2, 5]


def test_shrinks_when_far_under_target_and_holds_in_between():
    pol = AutoscalePolicy(1, 8, target_seconds=10.0)
    assert feed(pol, 6, [1, 1, 1]) == [6, 6, 2]   # 6 * 1 / 5 = 1.2 -> 2
    pol = AutoscalePolicy(1, 8, target_seconds=10.0)
    assert feed(pol, 4, [5, 7, 4, 6, 3.5, 7.5]) == [4] * 6  # between 3 s and 8 s: stays


def test_bounds_and_at_least_one_step():
    pol = AutoscalePolicy(2, 3, target_seconds=1.0)
    assert feed(pol, 3, [100, 100, 100]) == [3, 3, 3]   # at the maximum already
    assert feed(AutoscalePolicy(2, 3, target_seconds=1.0), 3, [0.01] * 3) == [3, 3, 2]  # not below 2
    # just over the up threshold: the formula says P, the step is still +1
    assert feed(AutoscalePolicy(1, 8, target_seconds=10.0), 4, [8.1] * 3) == [4, 4, 7]
    assert feed(AutoscalePolicy(1, 8, target_seconds=10.0), 1, [8.5] * 3) == [1, 1, 2]


def test_one_slow_batch_does_not_flip_it_and_it_waits_after_a_change():
    pol = AutoscalePolicy(1, 8, target_seconds=10.0)
    assert feed(pol, 2, [4, 30, 4, 4]) == [2, 2, 2, 2]  # the median ignores the outlier
    pol = AutoscalePolicy(1, 8, target_seconds=10.0)
    p = feed(pol, 2, [12, 12, 12])[-1]
    assert p == 5
    # the batch that moved state is not counted; then a full window at the new parallelism
    assert pol.observe(5, 40.0, rescaled=True) == 5
    assert feed(pol, 5, [1.0, 1.0]) == [5, 5]
    assert pol.observe(5, 1.0) == 1


def test_rate_triples_then_drops_back():
    """Batch time proportional to rows / P: the policy follows the rate up and back down."""
    pol = AutoscalePolicy(1, 8, target_seconds=10.0)
    p, seen = 2, []
    for rows in [10] * 6 + [30] * 9 + [10] * 9:
        t = rows / p  # 10 rows at P=2: 5 s, inside the band
        p = pol.observe(p, t)
        seen.append(p)
    assert seen[:6] == [2] * 6
    assert max(seen[6:15]) >= 6 and seen[14] >= 6       # 30 rows: 15 s at P=2 -> grows
    assert seen[-1] < seen[14] and 2 <= seen[-1] <= 4   # back to the slow rate: shrinks
    changes = sum(1 for a, b in zip(seen, seen[1:]) if a != b)
    assert changes <= 4


def test_bad_policies_are_clear_errors():
    with pytest.raises(ValueError, match="minimum exceeds the maximum"):
        AutoscalePolicy(4, 2)
    with pytest.raises(ValueError, match="min parallelism must be an int >= 1, got 0"):
        AutoscalePolicy(0, 2)
    with pytest.raises(ValueError, match="target_seconds must be > 0"):
        AutoscalePolicy(1, 2, target_seconds=0)
    with pytest.raises(ValueError, match="0 < down < aim < up"):
        AutoscalePolicy(1, 2, down=0.6)
    with pytest.raises(ValueError, match=r"must be \(min, max\)"):
        AutoscalePolicy.of(4)
    assert AutoscalePolicy.of((1, 4, 2.5)).target_seconds == 2.5
    with pytest.raises(ValueError, match="autoscale maximum 9 exceeds max_parallelism 8"):
        AutoscalePolicy.of((1, 9), max_parallelism=8)
