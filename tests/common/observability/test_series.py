"""Per-second request rate and latency quantiles from a tier's own metric families."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from common.observability.series import RequestSeries, bucket_quantile

BOUNDS = (0.01, 0.1, 1.0)


def test_quantile_of_nothing_is_unknown() -> None:
    assert bucket_quantile(0.5, BOUNDS, [0, 0, 0, 0]) is None


def test_quantile_is_linear_inside_its_bucket() -> None:
    # 10 observations, all in (0.01, 0.1]: the median sits halfway through that bucket.
    assert bucket_quantile(0.5, BOUNDS, [0, 10, 0, 0]) == pytest.approx(0.055)


def test_quantile_in_the_first_bucket_starts_from_zero() -> None:
    assert bucket_quantile(0.5, BOUNDS, [4, 0, 0, 0]) == pytest.approx(0.005)


def test_quantile_skips_empty_buckets() -> None:
    # 9 fast, 1 slow: p50 among the fast ones, p99 in (0.1, 1.0].
    counts = [9, 0, 1, 0]
    assert bucket_quantile(0.5, BOUNDS, counts) == pytest.approx(0.01 * 5 / 9)
    assert bucket_quantile(0.99, BOUNDS, counts) == pytest.approx(0.1 + 0.9 * 0.9)


def test_quantile_in_the_overflow_bucket_is_the_highest_bound() -> None:
    assert bucket_quantile(0.99, BOUNDS, [0, 0, 0, 5]) == 1.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def families() -> tuple[Counter, Histogram]:
    registry = CollectorRegistry()
    requests = Counter("r", "", ("tier", "model", "status", "tenant"), registry=registry)
    duration = Histogram("d", "", ("tier", "model", "status"), registry=registry, buckets=BOUNDS)
    return requests, duration


def test_a_point_is_the_change_over_the_last_second() -> None:
    requests, duration = families()
    clock = Clock()
    series = RequestSeries(requests, duration, bounds=BOUNDS, clock=clock, wall_clock=Clock(1.7e9))
    requests.labels("global", "m", "OK", "-").inc(5)
    assert series.sample() is None  # the first read is only a baseline

    clock.now += 1.0
    for _ in range(8):
        requests.labels("global", "m", "OK", "-").inc()
        duration.labels("global", "m", "OK").observe(0.05)
    for _ in range(2):
        requests.labels("global", "m", "UNAVAILABLE", "-").inc()
        duration.labels("global", "m", "UNAVAILABLE").observe(0.5)  # not in the latency
    point = series.sample()
    assert point is not None
    assert point.rps == 10 and point.errors_per_s == 2
    assert (point.requests, point.errors) == (10, 2)
    assert point.p50_ms == pytest.approx(55.0)
    assert point.p99_ms is not None and point.p99_ms < 100

    clock.now += 2.0  # a quiet two seconds
    point = series.sample()
    assert point is not None
    assert (point.rps, point.errors_per_s, point.p50_ms) == (0, 0, None)
    assert [p["rps"] for p in series.json()] == [10, 0]
    assert series.json(1) == [series.json()[-1]]
    assert series.json(0) == []

    clock.now += 2.0  # the sampler woke late: the rate is per second, the count exact
    requests.labels("global", "m", "OK", "-").inc(6)
    point = series.sample()
    assert point is not None and (point.requests, point.rps) == (6, 3)


def test_rates_use_the_monotonic_clock_and_t_the_wall_clock() -> None:
    requests, duration = families()
    clock, wall = Clock(), Clock(1.7e9)
    series = RequestSeries(requests, duration, bounds=BOUNDS, clock=clock, wall_clock=wall)
    series.sample()
    clock.now += 1.0
    wall.now -= 3600.0  # the wall clock is stepped back an hour meanwhile
    requests.labels("global", "m", "OK", "-").inc(4)
    point = series.sample()
    assert point is not None and point.rps == 4 and point.t == wall.now
