"""The run bucket by bucket, and how long the tail took to recover after an event.

``build_timeline`` makes one pass over the served requests (arrival bucket, the
bucket their last token arrived in, the region that served them), sorts each
bucket's latencies once and reads every trailing window's P99 from the buckets'
tails (``sim.stats.window_percentile``). ``recovery_after`` reads a ``Timeline``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sim.results import Recovery, Timeline
from sim.stats import first_recovered, median, window_percentile

BASELINE_S = 60.0  # the windows before an event its baseline P99 is the median of
RECOVERY_FACTOR = 1.2  # "back within 1.2× of its value before"
P99 = 0.99


@dataclass(frozen=True)
class Columns:
    """The recorder's served columns, with one label per route id (e.g. its region)."""

    at: Sequence[float]
    e2e: Sequence[float]
    route: Sequence[int]
    label_of_route: Sequence[str]


def build_timeline(
    served: Columns,
    failed_at: Sequence[float],
    *,
    start_s: float,
    duration_s: float,
    bucket_s: float,
    window: int,
) -> Timeline:
    """Buckets of ``bucket_s`` from ``start_s`` to ``duration_s``; arrivals later than
    that land in the last bucket, finishes later than that in none."""
    n = max(1, math.ceil((duration_s - start_s) / bucket_s - 1e-9))
    regions = sorted(set(served.label_of_route))
    region_of = [regions.index(r) for r in served.label_of_route]
    latencies: list[list[float]] = [[] for _ in range(n)]
    per_region = [[0] * n for _ in regions]
    finished = [0] * n
    last = n - 1
    for at, e2e, route in zip(served.at, served.e2e, served.route, strict=True):
        b = min(int((at - start_s) / bucket_s), last)
        latencies[b].append(e2e)
        per_region[region_of[route]][b] += 1
        f = int((at + e2e - start_s) / bucket_s)
        if f <= last:
            finished[f] += 1
    failed = [0] * n
    for at in failed_at:
        failed[min(int((at - start_s) / bucket_s), last)] += 1
    for bucket in latencies:
        bucket.sort()
    p99 = [
        _round(window_percentile(latencies[max(0, i - window + 1) : i + 1], P99), 4)
        for i in range(n)
    ]
    served_in = [len(b) for b in latencies]
    shares = {
        region: [round(c / s, 4) if s else None for c, s in zip(counts, served_in, strict=True)]
        for region, counts in zip(regions, per_region, strict=True)
    }
    return Timeline(
        start_s=start_s,
        bucket_s=bucket_s,
        window_buckets=window,
        arrived=[s + f for s, f in zip(served_in, failed, strict=True)],
        finished=finished,
        failed=failed,
        p99_e2e_s=p99,
        region_share=shares,
    )


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def recovery_after(timeline: Timeline, at_s: float, label: str) -> Recovery:
    """How the windowed P99 fared after the event at ``at_s`` (see ``Recovery``).

    The baseline is the median of the windows that end in the ``BASELINE_S``
    before the event (they hold no arrival after it); recovery is measured to the
    start of the first window, wholly after the event, back within the factor.
    """
    p99, w = timeline.p99_e2e_s, timeline.window_buckets
    # The first bucket that starts at or after the event.
    event = max(0, math.ceil((at_s - timeline.start_s) / timeline.bucket_s - 1e-9))
    before = [
        v
        for i, v in enumerate(p99[:event])
        if v is not None and timeline.time_s(i) + timeline.bucket_s > at_s - BASELINE_S
    ]
    baseline = median(before)
    if baseline is None:
        return Recovery(at_s, label, baseline_p99_s=None, peak_p99_s=None, recovery_s=None)
    start = first_recovered(
        p99, event_bucket=event, window=w, baseline=baseline, factor=RECOVERY_FACTOR
    )
    stop = len(p99) if start is None else start + w
    peak = max((v for v in p99[event:stop] if v is not None), default=None)
    recovery = None if start is None else max(0.0, timeline.time_s(start) - at_s)
    return Recovery(at_s, label, baseline_p99_s=baseline, peak_p99_s=peak, recovery_s=recovery)
