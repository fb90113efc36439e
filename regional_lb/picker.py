"""ZonePicker: the regional tier's one decision — which zone serves a request.

Zone-aware routing in the manner of Envoy's: the request's own zone (the zone
nearest its origin) keeps the request while it has *headroom* — free slots
in its newest capacity report (summary or response hint) less what this tier
has sent it since. When it has none, the request spills to the other zones
with probability in proportion to their headroom, so the excess spreads over
the zones that can take it. With no headroom anywhere, zones are tried in
proximity order (the local tiers queue or shed). A zone that just came back
keeps only its fail-back ramp's share of its own traffic, and other zones'
headroom is scaled by theirs (slow start).

Left out: zones down by direct evidence, and zones whose fresh summary says
they have no healthy GPU for the model. A zone with no fresh report has
unknown headroom and counts as having room (direct evidence says it is up).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.basics.geo import GeoPoint, great_circle_km
from common.request.children import Child
from common.request.pick import PickRequest
from common.request.resilience import SlowStartConfig, ramp_factor

UNKNOWN_HEADROOM = 1.0


def headroom(zone: Child, model: str, now: float, ttl_s: float) -> float:
    """Free slots this tier may still count on in ``zone`` (unknown: ``UNKNOWN_HEADROOM``)."""
    entry = zone.model_capacity(model, now, ttl_s)
    if entry is None:
        return UNKNOWN_HEADROOM
    sent_since = max(0, zone.outstanding_requests - zone.outstanding_at_report)
    return max(0.0, entry.free_slots - entry.queued_requests - sent_since)


@dataclass
class ZonePicker:
    """Own zone while it has headroom; spill in proportion to the others' headroom."""

    home: GeoPoint
    summary_ttl_s: float
    failback: SlowStartConfig = field(default_factory=lambda: SlowStartConfig(window_s=10.0))
    rng: random.Random = field(default_factory=random.Random)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        origin = request.origin or self.home
        zones = [c for c in children if c.may_serve(request.model, now, self.summary_ttl_s)]
        if not zones:
            return []
        zones.sort(key=lambda z: great_circle_km(origin, z.location or self.home))
        ramps = [ramp_factor(now - z.healthy_since, self.failback) for z in zones]
        rooms = [
            headroom(z, request.model, now, self.summary_ttl_s) * ramp
            for z, ramp in zip(zones, ramps, strict=True)
        ]
        # The request's own zone keeps it while it has room (a zone just back takes
        # only its ramp's share at first).
        if rooms[0] > 0 and (ramps[0] >= 1.0 or self.rng.random() < ramps[0]):
            return zones
        total = sum(rooms[1:])
        if total <= 0:
            return zones
        u = self.rng.random() * total
        for i in range(1, len(zones)):
            u -= rooms[i]
            if u < 0:
                return [zones[i], *zones[:i], *zones[i + 1 :]]
        return zones
