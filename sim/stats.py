"""Small pure formulas the fleet simulator's measurements are made of.

Percentiles are exact (linear interpolation between order statistics, the
"inclusive" definition of ``statistics.quantiles`` and numpy's default), never
read off a histogram, and take ``math.inf`` for a request that failed (it never
completed: infinitely late), so a percentile among the failures reads inf.
``window_percentile`` gets the same figure for a window of time buckets from each
bucket's largest values only, so a sliding P99 over a million requests costs one
sort per bucket rather than one per window.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ascending ``ordered``; None when it is empty."""
    n = len(ordered)
    if n == 0:
        return None
    pos = q * (n - 1)
    lo = int(pos)
    if lo >= n - 1:
        return float(ordered[n - 1])
    frac = pos - lo
    a, b = ordered[lo], ordered[lo + 1]
    if b == math.inf:  # failures count as infinitely late: between one and a time, inf
        return float(a) if frac == 0 else math.inf
    return float(a + (b - a) * frac)


def tail_needed(n: int, q: float) -> int:
    """How many of the largest of ``n`` values ``percentile(q)`` reads (at least one)."""
    return max(1, n - int(q * (n - 1))) if n else 0


def window_percentile(buckets: Sequence[Sequence[float]], q: float) -> float | None:
    """``percentile`` over the union of ascending ``buckets``, reading only their tails.

    The union's top ``tail_needed`` values are among the union of each bucket's
    top ``tail_needed`` values; sorting those few is exact and cheap for q near 1.
    """
    n = sum(len(b) for b in buckets)
    if n == 0:
        return None
    t = tail_needed(n, q)
    tops = sorted(v for b in buckets for v in b[-t:])[-t:]
    # ``tops[i]`` is the union's order statistic of rank n - t + i.
    pos = q * (n - 1)
    lo = int(pos)
    first = n - t
    if lo >= n - 1:
        return float(tops[-1])
    a, b = tops[lo - first], tops[lo + 1 - first]
    return float(a + (b - a) * (pos - lo))


def pstdev(values: Sequence[float]) -> float | None:
    """Population standard deviation; None when there is no value."""
    n = len(values)
    if n == 0:
        return None
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)


def downsample(ordered: Sequence[float], points: int) -> list[float]:
    """At most ``points`` values of ``ordered`` spread evenly, first and last kept."""
    n = len(ordered)
    if n <= points:
        return [float(v) for v in ordered]
    if points == 1:
        return [float(ordered[-1])]
    return [float(ordered[round(i * (n - 1) / (points - 1))]) for i in range(points)]


def first_recovered(
    windowed: Sequence[float | None],
    *,
    event_bucket: int,
    window: int,
    baseline: float,
    factor: float = 1.2,
) -> int | None:
    """The first bucket b >= ``event_bucket`` from which a whole window of arrivals
    (buckets b .. b+window-1, the trailing window ending at b+window-1) has its P99
    within ``factor`` × ``baseline``; None when that never happens.

    ``windowed[i]`` is the P99 over the trailing window ending at bucket i. Asking
    for a window that starts after the event keeps arrivals from before it (which
    never saw the failure) from hiding the damage.
    """
    limit = factor * baseline
    for end in range(event_bucket + window - 1, len(windowed)):
        value = windowed[end]
        if value is not None and value <= limit:
            return end - window + 1
    return None


def median(values: Sequence[float]) -> float | None:
    """The median (None when empty)."""
    return percentile(sorted(values), 0.5)


@dataclass(frozen=True)
class Swing:
    """How a share series moved: its mean, spread and largest step between neighbours."""

    mean: float
    std: float
    max_swing: float


def swing(series: Sequence[float | None]) -> Swing | None:
    """``Swing`` of the known values (None entries, buckets without traffic, skipped);
    the largest step is taken between consecutive known values."""
    known = [v for v in series if v is not None]
    if not known:
        return None
    steps = [abs(b - a) for a, b in itertools.pairwise(known)]
    std = pstdev(known)
    assert std is not None
    return Swing(mean=math.fsum(known) / len(known), std=std, max_swing=max(steps, default=0.0))


def cumulative_shares(weighted: Sequence[tuple[T, float]]) -> list[tuple[float, T]]:
    """``(cumulative share, item)`` per ``(item, weight)``, the last share exactly 1, so a
    uniform draw ``u`` in [0, 1) picks the first item whose share exceeds it."""
    total = math.fsum(w for _, w in weighted)
    out: list[tuple[float, T]] = []
    acc = 0.0
    for item, weight in weighted:
        acc += weight / total
        out.append((acc, item))
    if out:
        out[-1] = (1.0, out[-1][1])
    return out


# An infinite figure in JSON (a percentile among failed requests, a region with no
# capacity): plain JSON has no infinity.
INFINITE = "inf"


def infinite_as_text(value: Any) -> Any:
    """``value`` (JSON types) with every infinite float as ``INFINITE``."""
    if isinstance(value, float) and math.isinf(value):
        return INFINITE
    if isinstance(value, dict):
        return {k: infinite_as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [infinite_as_text(v) for v in value]
    return value


def infinite_from_text(value: Any) -> Any:
    """``infinite_as_text`` undone."""
    if value == INFINITE:
        return math.inf
    if isinstance(value, Mapping):
        return {k: infinite_from_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [infinite_from_text(v) for v in value]
    return value
