"""RegionPicker: the global tier's one decision — which region serves a request.

Regions are ranked by great-circle distance from the client's location (its
``x-meridian-client-geo``, else the location of its ``x-meridian-client-region``,
else the global tier's own location), nearest first. A region is left out
when direct evidence says it is down, or when its fresh capacity summary says
it has no healthy GPU for the model; a region whose summary is stale is still
routed to on direct health evidence alone. The next-nearest region is the
failover.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.children import Child
from common.geo import GeoPoint, great_circle_km
from common.pick import PickRequest


@dataclass
class RegionPicker:
    """Nearest healthy region with the model first."""

    home: GeoPoint
    summary_ttl_s: float

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        origin = request.origin or self.home
        eligible = [c for c in children if c.may_serve(request.model, now, self.summary_ttl_s)]
        eligible.sort(key=lambda c: great_circle_km(origin, c.location or self.home))
        return eligible
