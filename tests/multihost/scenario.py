"""The two partitions, run under load and reduced to figures (the tests and ``bench.partition``).

``partition``: the link between the global host and one region's host is cut silently
(every process keeps running: no RST, no FIN), held, then healed. Figures: when answers
from other regions came after the cut (``moved_s``), when the requests in flight at the
cut were answered, failures before and after the cut was ``GRACE_S`` old, usage records
against requests, and the region's share per second after the heal (a ramp, not a step).

``redis_cut``: a region's host is cut from its Redis. Its tiers can publish no capacity
summary to it (freshness degrades: its zones' streams stop), but they keep serving.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.capacity.streams import zone_stream
from tests.client import Sample, region_of
from tests.multihost.fleet import MultiHostFleet
from tests.multihost.load import PacedLoad, buckets

GRACE_S = 2.0  # the promise: no request fails once the partition is this old


@dataclass
class Phases:
    before_s: float = 3.0
    cut_s: float = 6.0
    after_s: float = 10.0
    rate_per_s: float = 60.0
    clients: int = 4


@dataclass
class PartitionRun:
    region: str
    cut: float
    heal: float
    end: float
    samples: list[Sample]
    usage_records: int
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def started(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples if t0 <= s.started < t1]

    def failures(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.started(t0, t1) if s.code != grpc.StatusCode.OK]

    @property
    def caught(self) -> list[Sample]:
        """Requests in flight when the link was cut."""
        return [s for s in self.samples if s.started <= self.cut < s.ended]

    @property
    def moved_s(self) -> float | None:
        """Cut → the first answer from another region to a request in flight at the cut
        or sent after it (an answer of the cut region may still arrive just after the cut:
        it was on its way). Meaningful when the region had all the traffic before."""
        answered = [
            s.ended
            for s in self.samples
            if s.ended > self.cut
            and s.code == grpc.StatusCode.OK
            and region_of(s.route) != self.region
        ]
        return min(answered) - self.cut if answered else None

    @property
    def caught_answered_s(self) -> float:
        """Cut → the last request in flight at the cut answered (by another region)."""
        return max((s.ended - self.cut for s in self.caught), default=0.0)

    def served_by(self, region: str, t0: float, t1: float) -> int:
        return sum(
            1
            for s in self.started(t0, t1)
            if s.code == grpc.StatusCode.OK and region_of(s.route) == region
        )

    def share_after_heal(self, width_s: float = 1.0) -> list[tuple[float, float]]:
        """(seconds since the heal, the region's share of the requests started then)."""
        out = []
        for t, count in buckets(self.samples, self.heal, self.end, width_s):
            total = sum(count.values())
            out.append((t, count.get(self.region, 0) / total if total else 0.0))
        return out

    def figures(self) -> dict[str, Any]:
        during = self.started(self.cut, self.heal)
        return {
            "region": self.region,
            "requests": len(self.samples),
            "usage_records": self.usage_records,
            "moved_s": None if self.moved_s is None else round(self.moved_s, 3),
            "in_flight_at_cut": len(self.caught),
            "in_flight_at_cut_failed": sum(s.code != grpc.StatusCode.OK for s in self.caught),
            "in_flight_at_cut_answered_s": round(self.caught_answered_s, 3),
            "served_by_cut_region_before_cut": self.served_by(
                self.region, self.cut - 2.0, self.cut
            ),
            "requests_2s_before_cut": len(self.started(self.cut - 2.0, self.cut)),
            "failures_first_2s": len(self.failures(self.cut, self.cut + GRACE_S)),
            "failures_after_2s": len(self.failures(self.cut + GRACE_S, self.end)),
            "failures_total": len(self.failures(0.0, float("inf"))),
            "served_by_cut_region_during_cut": self.served_by(self.region, self.cut, self.heal),
            "requests_during_cut": len(during),
            "partition_s": round(self.heal - self.cut, 3),
            "share_after_heal": [[t, round(v, 3)] for t, v in self.share_after_heal()],
        }


def settled_usage(fleet: MultiHostFleet, timeout_s: float = 5.0) -> int:
    """The usage records in the global Redis once the count stops moving (the recorder
    flushes every 100 ms; 0.5 s without a change) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    count = fleet.usage_records()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = fleet.usage_records()
        if now == count:
            break
        count = now
    return count


def partition(fleet: MultiHostFleet, region: str, phases: Phases) -> PartitionRun:
    """Load from a client near ``region``; cut global—``region``, hold, heal; measure."""
    before = settled_usage(fleet)
    metadata = fleet.beside(region)
    with PacedLoad(
        fleet.global_target, metadata, clients=phases.clients, rate_per_s=phases.rate_per_s
    ) as load:
        time.sleep(phases.before_s)
        cut = fleet.hosts.cut("global", region)
        try:
            time.sleep(phases.cut_s)
        finally:
            heal = fleet.hosts.heal("global", region)
        time.sleep(phases.after_s)
        end = time.monotonic()
    samples = load.snapshot()
    usage = settled_usage(fleet) - before
    start = cut - phases.before_s
    timeline = [(t, dict(c)) for t, c in buckets(samples, start, end)]
    return PartitionRun(region, cut, heal, end, samples, usage, timeline)


@dataclass
class RedisCutRun:
    region: str
    cut: float
    heal: float
    samples: list[Sample]
    stream_advanced_during_cut: int  # zone summaries written while cut (expect 0)
    stream_resumed_s: float | None  # heal → the first new zone summary

    def figures(self) -> dict[str, Any]:
        during = [s for s in self.samples if self.cut <= s.started < self.heal]
        failed = [s for s in self.samples if s.code != grpc.StatusCode.OK]
        return {
            "region": self.region,
            "requests": len(self.samples),
            "requests_during_cut": len(during),
            "served_by_region_during_cut": sum(
                s.code == grpc.StatusCode.OK and region_of(s.route) == self.region for s in during
            ),
            "failures": len(failed),
            "zone_summaries_during_cut": self.stream_advanced_during_cut,
            "summaries_resumed_s": (
                None if self.stream_resumed_s is None else round(self.stream_resumed_s, 3)
            ),
        }


def _summaries_since(fleet: MultiHostFleet, region: str, since_ms: int) -> int:
    """Zone summaries of ``region`` written to its Redis after ``since_ms`` (its local
    tiers write them to the Redis the region uses, with or without a Redis per region)."""
    zones = [z.name for z in fleet.topology.region(region).zones]
    with fleet.redis_client(fleet.redis_host_of(region)) as client:
        return sum(
            len(client.xrange(zone_stream(region, zone), min=f"{since_ms + 1}", max="+"))
            for zone in zones
        )


def _redis_ms(fleet: MultiHostFleet, region: str) -> int:
    with fleet.redis_client(fleet.redis_host_of(region)) as client:
        seconds, micros = client.time()
        return int(seconds) * 1000 + int(micros) // 1000


def redis_cut(fleet: MultiHostFleet, region: str, phases: Phases) -> RedisCutRun:
    """Load from a client near ``region`` while its host is cut from its Redis."""
    metadata = fleet.beside(region)
    redis_host = fleet.redis_host_of(region)
    with PacedLoad(
        fleet.global_target, metadata, clients=phases.clients, rate_per_s=phases.rate_per_s
    ) as load:
        time.sleep(phases.before_s)
        cut = fleet.hosts.cut(region, redis_host, at=region)
        # A summary may still be on its way at the cut; count only what follows.
        time.sleep(0.5)
        cut_ms = _redis_ms(fleet, region)
        try:
            time.sleep(max(0.0, phases.cut_s - 0.5))
            during = _summaries_since(fleet, region, cut_ms)
        finally:
            heal = fleet.hosts.heal(region, redis_host)
        heal_ms = _redis_ms(fleet, region)
        resumed = None
        deadline = heal + phases.after_s
        while time.monotonic() < deadline:
            if resumed is None and _summaries_since(fleet, region, heal_ms):
                resumed = time.monotonic() - heal
            time.sleep(0.1)
    return RedisCutRun(region, cut, heal, load.snapshot(), during, resumed)


def timeline_rows(
    timeline: Sequence[tuple[float, dict[str, int]]], regions: Sequence[str]
) -> list[list[Any]]:
    """One row per second: t, then requests served by each region, then failures."""
    return [[t, *(c.get(r, 0) for r in regions), c.get("FAILED", 0)] for t, c in timeline]
