"""Metrics of what a tier depends on, read at scrape time: its Redis clients, and at
the edge the buffer of usage records on their way to Redis.

A Redis outage degrades freshness, never availability: routing goes on, summaries age,
quotas are kept in process. These families say that it is happening
(``meridian_redis_up``) and whether billing data is at risk: usage records waiting
for Redis, and those dropped because the buffer was full
(``meridian_usage_records_dropped_total``, which should stay 0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from common.observability.tier_metrics import TierMetrics


class UsageBuffer(Protocol):
    """What the metrics read of the edge's usage recorder (``tenancy.usage.UsageRecorder``)."""

    written: int
    dropped: int

    @property
    def pending(self) -> int: ...


def add_redis_metrics(metrics: TierMetrics, clients: Mapping[str, Callable[[], bool]]) -> None:
    """``meridian_redis_up``: each Redis client of the tier (by role), 1 while its last
    Redis call succeeded, 0 from a failure until one succeeds again."""
    tier = metrics.tier
    metrics.scraped(
        "meridian_redis_up",
        "1 while this Redis client's last call succeeded, 0 while it reconnects.",
        ("tier", "client"),
        lambda: [((tier, name), float(up())) for name, up in clients.items()],
    )


def add_usage_metrics(metrics: TierMetrics, usage: UsageBuffer) -> None:
    """The edge's usage records: written to Redis, waiting, dropped (buffer full)."""
    tier = metrics.tier
    metrics.scraped(
        "meridian_usage_records_written",
        "Usage records written to Redis since the process started.",
        ("tier",),
        lambda: [((tier,), float(usage.written))],
        kind="counter",
    )
    metrics.scraped(
        "meridian_usage_records_dropped",
        "Usage records dropped because the buffer waiting for Redis was full.",
        ("tier",),
        lambda: [((tier,), float(usage.dropped))],
        kind="counter",
    )
    metrics.scraped(
        "meridian_usage_records_pending",
        "Usage records buffered and not yet known to be written to Redis.",
        ("tier",),
        lambda: [((tier,), float(usage.pending))],
    )
