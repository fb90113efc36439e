"""The measurement formulas, one named case each, against the standard library."""

from __future__ import annotations

import random
import statistics

import pytest

from sim.stats import downsample, first_recovered, percentile, pstdev, swing, window_percentile


def test_percentile_matches_the_standard_librarys_inclusive_quantiles() -> None:
    rng = random.Random(1)
    values = sorted(rng.expovariate(1.0) for _ in range(1001))
    expected = statistics.quantiles(values, n=100, method="inclusive")
    for q in (1, 10, 50, 90, 99):
        assert percentile(values, q / 100) == pytest.approx(expected[q - 1], rel=1e-12)


def test_percentile_of_one_value_and_of_none() -> None:
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.5) is None


@pytest.mark.parametrize("sizes", [[0, 0], [1], [1, 1, 1], [5, 0, 300], [40] * 10, [1000, 3]])
def test_window_percentile_from_bucket_tails_equals_the_full_sort(sizes: list[int]) -> None:
    rng = random.Random(sum(sizes))
    buckets = [sorted(rng.lognormvariate(0, 1) for _ in range(n)) for n in sizes]
    union = sorted(v for b in buckets for v in b)
    for q in (0.5, 0.9, 0.99, 1.0):
        assert window_percentile(buckets, q) == percentile(union, q)


def test_pstdev_is_the_population_standard_deviation() -> None:
    values = [0.2, 0.5, 0.8, 1.0, 1.0]
    assert pstdev(values) == pytest.approx(statistics.pstdev(values))
    assert pstdev([]) is None


def test_downsample_keeps_order_and_both_ends() -> None:
    values = [float(i) for i in range(1000)]
    picked = downsample(values, 200)
    assert len(picked) == 200 and picked == sorted(picked)
    assert (picked[0], picked[-1]) == (0.0, 999.0)
    assert downsample(values[:5], 200) == values[:5]


def test_first_recovered_wants_a_whole_window_after_the_event_within_the_factor() -> None:
    # Trailing windows of 3: the window ending at i covers buckets i-2..i.
    windowed = [1.0, 1.0, 2.0, 2.0, 2.0, 1.1, 1.3, 1.0, 1.0]
    # The window ending at 5 (buckets 3..5) is the first within 1.2×; at 1.05× the one at 7.
    assert first_recovered(windowed, event_bucket=2, window=3, baseline=1.0) == 3
    assert first_recovered(windowed, event_bucket=2, window=3, baseline=1.0, factor=1.05) == 5
    assert first_recovered([2.0] * 9, event_bucket=2, window=3, baseline=1.0) is None


def test_swing_is_spread_and_largest_step_of_the_known_shares() -> None:
    moved = swing([0.5, None, 0.9, 0.1, 0.5])
    assert moved is not None
    assert moved.std == pytest.approx(statistics.pstdev([0.5, 0.9, 0.1, 0.5]))
    assert moved.max_swing == pytest.approx(0.8)
    assert moved.mean == pytest.approx(0.5)
    assert swing([None]) is None
