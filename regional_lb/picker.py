"""ZonePicker: the regional tier's one decision — which zone serves a request.

Zones of a region are a millisecond or two apart, so load decides, not
proximity. Each zone that may serve gets a score, lower is better:

    score_ms = RTT estimate from the request's origin to the zone
             + the zone's expected wait (its newest report, summary or response hint,
               grown by the requests this tier sent it since: common.capacity.summary)

and the zones are ranked by it: the request's own zone wins while no other is
less busy by more than the distance, and between reports the zone that keeps
receiving looks busier, so requests spread instead of herding to the one that
looked best (the fleet simulator showed the old rule — own zone while it has a
free slot — leaving zones of one region at 10 % and 19 % busy, README "The fleet
simulator"). A zone with no slot left (headroom: free slots less queued and sent
since) is scored ``FULL_ZONE_MS`` further away, so it is tried last; a zone with no
fresh report is scored as ``UNKNOWN_WAIT_MS`` busy. A zone that just came back is
considered only with its fail-back ramp's probability (slow start).

Left out: zones down by direct evidence, and zones whose fresh summary says
they have no healthy GPU for the model.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.basics.geo import GeoPoint, great_circle_km, rtt_estimate_ms
from common.capacity.summary import expected_wait_s
from common.gen.meridian.v1 import capacity_pb2
from common.request.children import Child
from common.request.pick import PickRequest, sent_since_report, sent_work_since_report
from common.request.resilience import SlowStartConfig, ramp_factor

UNKNOWN_HEADROOM = 1.0
# A zone with no fresh report is scored as if this busy; a zone with no slot left
# as this much further away (it still ranks, for when every zone is full).
UNKNOWN_WAIT_MS = 50.0
FULL_ZONE_MS = 10_000.0


def headroom(zone: Child, model: str, now: float, ttl_s: float) -> float:
    """Free slots this tier may still count on in ``zone`` (unknown: ``UNKNOWN_HEADROOM``)."""
    return headroom_in(zone, zone.model_capacity(model, now, ttl_s))


def headroom_in(zone: Child, entry: capacity_pb2.ModelCapacity | None) -> float:
    """``headroom`` from the zone's report ``entry`` (None: unknown)."""
    if entry is None:
        return UNKNOWN_HEADROOM
    return max(0.0, entry.free_slots - entry.queued_requests - sent_since_report(zone))


@dataclass
class ZonePicker:
    """Own zone while it has headroom; spill in proportion to the others' headroom."""

    home: GeoPoint
    summary_ttl_s: float
    failback: SlowStartConfig = field(default_factory=lambda: SlowStartConfig(window_s=10.0))
    rng: random.Random = field(default_factory=random.Random)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        origin, home = request.origin or self.home, self.home
        # Each zone's report is looked at once, for may_serve and for its headroom.
        serving = []
        for zone in children:
            serves, entry = zone.serving_capacity(request.model, now, self.summary_ttl_s)
            if serves:
                serving.append((zone, entry))
        if not serving:
            return []
        scored = []
        for zone, entry in serving:
            ramp = ramp_factor(now - zone.healthy_since, self.failback)
            if ramp < 1.0 and self.rng.random() >= ramp:
                continue  # a zone just back takes only its ramp's share at first
            scored.append((self.score_in(zone, entry, origin), zone))
        zones = [zone for zone, _ in serving]
        if not scored:
            return sorted(zones, key=lambda z: great_circle_km(origin, z.location or home))
        scored.sort(key=lambda s: s[0])
        ranked = [z for _, z in scored]
        return ranked + [z for z in zones if z not in ranked]

    def score_ms(self, zone: Child, request: PickRequest, now: float) -> float:
        """Distance as RTT plus the zone's expected wait, grown by what was sent since."""
        entry = zone.model_capacity(request.model, now, self.summary_ttl_s)
        return self.score_in(zone, entry, request.origin or self.home)

    def score_in(
        self,
        zone: Child,
        entry: capacity_pb2.ModelCapacity | None,
        origin: GeoPoint,
    ) -> float:
        """``score_ms`` from the zone's report ``entry`` (None: unknown)."""
        rtt = rtt_estimate_ms(origin, zone.location or self.home)
        if entry is None:
            return rtt + UNKNOWN_WAIT_MS
        if entry.total_slots and headroom_in(zone, entry) <= 0:
            return rtt + FULL_ZONE_MS + 1000.0 * entry.estimated_wait_s
        sent, sent_work = sent_since_report(zone), sent_work_since_report(zone)
        return rtt + 1000.0 * expected_wait_s(entry, sent, sent_work, zone.outstanding_work)
