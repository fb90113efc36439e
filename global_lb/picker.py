"""RegionPicker: the global tier's one decision — which region serves a request.

Each eligible region gets a score, lower is better:

    score_ms = RTT estimate (measured matrix when configured, else great-circle distance)
             + expected wait (the region's newest report, grown by the requests this tier
               sent it since, common.capacity.summary.expected_wait_s; unknown = penalty)

and an *availability* with Envoy's priority/overprovisioning semantics:

    availability = min(1, 1.4 × healthy GPUs / total GPUs) × fail-back ramp

which drops to 0 while the region's newest report has no free slot left (less
what was sent since): a full region passes its excess on like an unhealthy one.

Regions are walked in score order like Envoy priority levels: the best region
takes min(its availability, what is left) of the traffic and the rest spills
to the next, so a region keeps all of its traffic while at least 1/1.4 of its
GPUs are healthy and sheds the excess otherwise. When the availabilities add
up to less than 1 they are normalised (every region degraded); below
``PANIC_THRESHOLD`` the picker panics and ignores summaries, ranking every
region that is up by direct evidence by score alone. A region that just came
back ramps its availability up over the fail-back window (slow start), so
traffic returns gradually instead of as a herd.

Eligible: up by direct evidence, serving the model, allowed for the tenant
(data residency), and not known (fresh summary) to have zero healthy GPUs. A
region whose summary is stale is unknown: routed on direct evidence, scored
with ``UNKNOWN_WAIT_MS``. The ranking returned is the chosen region first,
then the others by score, which is the failover order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.basics.geo import GeoPoint, rtt_estimate_ms
from common.capacity.summary import expected_wait_s
from common.gen.meridian.v1 import capacity_pb2
from common.request.children import Child
from common.request.pick import PickRequest, sent_since_report, sent_work_since_report
from common.request.resilience import SlowStartConfig, ramp_factor

OVERPROVISIONING = 1.4
PANIC_THRESHOLD = 0.5
UNKNOWN_WAIT_MS = 100.0
# A region whose every slot is taken keeps this share of its availability: the rest
# spills to the next regions by score, as an unhealthy share does (found in the fleet
# simulator: without it a region far busier than its neighbours kept its clients,
# queueing them, while the next region's GPUs idled).
FULL_REGION_SHARE = 0.0
# Origins whose estimated RTTs a picker keeps (client cities, declared regions).
ESTIMATED_ORIGINS = 4096


def full(region: Child, entry: capacity_pb2.ModelCapacity) -> bool:
    """No slot left in ``region``'s newest report, counting what was sent since."""
    return entry.free_slots - entry.queued_requests - sent_since_report(region) <= 0


def availability(healthy: int, total: int, ramp: float = 1.0) -> float:
    """Envoy's priority health: min(1, overprovisioning × healthy fraction), times the ramp."""
    if total <= 0:
        return ramp
    return min(1.0, OVERPROVISIONING * healthy / total) * ramp


def spill_shares(availabilities: Sequence[float]) -> list[float]:
    """Traffic share of each region, in score order (Envoy's priority load, normalised)."""
    total = sum(availabilities)
    if total <= 0:
        return [0.0 for _ in availabilities]
    scale = 1.0 / total if total < 1.0 else 1.0
    shares, left = [], 1.0
    for a in availabilities:
        share = min(a * scale, left)
        shares.append(share)
        left -= share
    return shares


@dataclass
class RegionPicker:
    """Score by RTT plus queueing, spill by health with overprovisioning, fail back slowly."""

    home: GeoPoint
    summary_ttl_s: float
    rtt_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    failback: SlowStartConfig = field(default_factory=lambda: SlowStartConfig(window_s=10.0))
    rng: random.Random = field(default_factory=random.Random)
    # Estimated RTTs by origin, then region: (the location it was estimated to, ms).
    # Every pick needs every region's, and requests come from a bounded set of
    # places; a region that moved (a reload) is estimated again. Bounded.
    _estimates: dict[GeoPoint, dict[str, tuple[GeoPoint, float]]] = field(
        default_factory=dict, init=False, repr=False
    )

    def follow_rtt(self, rtt_ms: Mapping[str, Mapping[str, float]]) -> None:
        """A reloaded topology's measured RTT matrix replaces the one it started with."""
        self.rtt_ms = rtt_ms

    def rtt(self, request: PickRequest, region: Child) -> float:
        row = self.rtt_ms.get(request.client_region or "")
        if row is not None and region.name in row:
            return row[region.name]
        return rtt_estimate_ms(request.origin or self.home, region.location or self.home)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        scored: list[tuple[float, float, Child]] = []
        model, allowed, ttl_s = request.model, request.allowed_regions, self.summary_ttl_s
        # rtt() hoisted out of the loop: the request's row and origin, once per request.
        row = self.rtt_ms.get(request.client_region or "")
        origin = request.origin or self.home
        estimates = self._estimates_from(origin)
        window_s = self.failback.window_s
        for region in children:
            if allowed and region.name not in allowed:
                continue
            serves, entry = region.serving_capacity(model, now, ttl_s)
            if not serves:
                continue
            since = now - region.healthy_since
            ramp = 1.0 if since >= window_s else ramp_factor(since, self.failback)
            if entry is None:
                wait_ms, avail = UNKNOWN_WAIT_MS, ramp
            else:
                wait_ms = 1000.0 * expected_wait_s(
                    entry,
                    sent_since_report(region),
                    sent_work_since_report(region),
                    region.outstanding_work,
                )
                avail = availability(
                    entry.healthy_gpus + entry.unknown_children,
                    entry.total_gpus + entry.unknown_children,
                    ramp,
                )
                if entry.total_slots and full(region, entry):
                    avail *= FULL_REGION_SHARE
            if row is not None and region.name in row:
                rtt_ms = row[region.name]
            else:
                location = region.location or self.home
                known = estimates.get(region.name)
                if known is not None and known[0] is location:
                    rtt_ms = known[1]
                else:
                    rtt_ms = rtt_estimate_ms(origin, location)
                    estimates[region.name] = (location, rtt_ms)
            scored.append((rtt_ms + wait_ms, avail, region))
        if not scored:
            return []
        scored.sort(key=lambda s: s[0])
        ranked = [region for _, _, region in scored]
        avails = [a for _, a, _ in scored]
        if sum(avails) < PANIC_THRESHOLD:
            return ranked  # panic: every region degraded, route by score alone
        u = self.rng.random()
        for i, share in enumerate(spill_shares(avails)):
            u -= share
            if u < 0:
                return [ranked[i], *ranked[:i], *ranked[i + 1 :]]
        return ranked

    def _estimates_from(self, origin: GeoPoint) -> dict[str, tuple[GeoPoint, float]]:
        estimates = self._estimates.get(origin)
        if estimates is None:
            if len(self._estimates) >= ESTIMATED_ORIGINS:
                self._estimates.clear()
            estimates = self._estimates[origin] = {}
        return estimates
