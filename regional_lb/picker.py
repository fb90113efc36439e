"""ZonePicker: the regional tier's one decision — which zone serves a request.

The request's own zone is the zone nearest to its origin (the client location
the global tier resolved); it comes first, then the other zones by distance,
so traffic stays in its zone and moves to a neighbour only when its zone is
down. Among zones at the same distance the one with less outstanding work
goes first. Zones with no healthy GPU for the model (per a fresh summary) or
down by direct evidence are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.children import Child
from common.geo import GeoPoint, great_circle_km
from common.pick import PickRequest


@dataclass
class ZonePicker:
    """Request's zone first, then the others by proximity."""

    home: GeoPoint
    summary_ttl_s: float

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        origin = request.origin or self.home
        eligible = [c for c in children if c.may_serve(request.model, now, self.summary_ttl_s)]
        eligible.sort(
            key=lambda c: (
                round(great_circle_km(origin, c.location or self.home)),
                c.outstanding_work,
            )
        )
        return eligible
