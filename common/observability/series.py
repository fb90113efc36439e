"""Request rate and latency over the last minutes: a ring of per-second samples.

``RequestSeries`` reads a tier's own metric families (``TierMetrics.requests`` and
``.duration``, prometheus_client families on the tier's registry, read through
``metrics.counter_values`` and ``histogram_counts``) once a second and keeps the
difference from the previous read:
calls answered, calls that failed, and latency quantiles of the successful ones,
estimated from the histogram's bucket counts the way Prometheus'
``histogram_quantile`` does (linear inside a bucket). Reading the counters
instead of hooking the request path means the request path stays untouched and
a second costs one pass over a few label sets.

The ring keeps ``capacity`` points (five minutes); ``/api/series`` serves it and
the dashboard and ``meridian top`` draw it. Rates divide by the time between reads
on the monotonic ``clock``; only a point's timestamp ``t`` is wall time
(``wall_clock``), so a clock step cannot make a rate negative or huge.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from prometheus_client import Counter, Histogram

from common.observability.metrics import LLM_BUCKETS, counter_values, histogram_counts

SERIES_POINTS = 300
QUANTILES = (0.5, 0.9, 0.99)


def bucket_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q`` quantile of observations counted (non-cumulatively) per bucket.

    ``counts`` has one entry per bound plus the +Inf bucket. Inside a bucket the
    observations are taken as spread evenly; a rank in the +Inf bucket reads as
    the highest finite bound. None when nothing was observed.
    """
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    running = 0.0
    lower = 0.0
    for bound, count in zip(bounds, counts, strict=False):
        if count > 0 and running + count >= rank:
            return lower + (bound - lower) * (rank - running) / count
        running += count
        lower = bound
    return bounds[-1]


@dataclass(frozen=True)
class SeriesPoint:
    """One second of one tier: calls answered and failed (counts and per second, as the
    sampler may wake a little late), latency of the successful ones in ms."""

    t: float  # unix time at the end of the interval
    requests: int
    errors: int
    rps: float
    errors_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


@dataclass
class _Totals:
    requests: float
    errors: float
    ok_counts: list[float]


class RequestSeries:
    """Per-second deltas of a tier's request counter and OK-latency histogram."""

    def __init__(
        self,
        requests: Counter,
        duration: Histogram,
        *,
        bounds: Sequence[float] = LLM_BUCKETS,
        capacity: int = SERIES_POINTS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.requests = requests
        self.duration = duration
        # The histogram's finite bucket bounds (its families do not say until observed).
        self.bounds = tuple(bounds)
        self.clock = clock
        self.wall_clock = wall_clock
        self.points: deque[SeriesPoint] = deque(maxlen=capacity)
        self._last: _Totals | None = None
        self._last_t = 0.0

    def _totals(self) -> _Totals:
        by_status = counter_values(self.requests, ("status",))
        requests = sum(by_status.values())
        errors = requests - by_status.get(("OK",), 0.0)
        ok = histogram_counts(self.duration, ("status",)).get(("OK",))
        return _Totals(requests, errors, ok or [0.0] * (len(self.bounds) + 1))

    def sample(self) -> SeriesPoint | None:
        """Take one point: what changed since the previous call (None on the first)."""
        now = self.clock()
        totals = self._totals()
        last, self._last = self._last, totals
        elapsed, self._last_t = now - self._last_t, now
        if last is None or elapsed <= 0:
            return None
        delta = [a - b for a, b in zip(totals.ok_counts, last.ok_counts, strict=True)]
        quantiles = [bucket_quantile(q, self.bounds, delta) for q in QUANTILES]
        p50, p90, p99 = (None if v is None else round(v * 1000, 2) for v in quantiles)
        point = SeriesPoint(
            t=round(self.wall_clock(), 3),
            requests=round(totals.requests - last.requests),
            errors=round(totals.errors - last.errors),
            rps=round((totals.requests - last.requests) / elapsed, 2),
            errors_per_s=round((totals.errors - last.errors) / elapsed, 2),
            p50_ms=p50,
            p90_ms=p90,
            p99_ms=p99,
        )
        self.points.append(point)
        return point

    def json(self, seconds: int | None = None) -> list[dict[str, float | None]]:
        points = list(self.points)
        if seconds is not None:
            points = points[-seconds:] if seconds > 0 else []
        return [asdict(p) for p in points]
