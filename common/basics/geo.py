"""Geography: points on the globe, great-circle distance, RTT estimates."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

EARTH_RADIUS_KM = 6371.0
# Light in fibre covers ~200 km per ms; real paths are ~1.5x the great circle.
FIBRE_KM_PER_MS = 200.0
ROUTE_STRETCH = 1.5


@dataclass(frozen=True)
class GeoPoint:
    """A latitude/longitude pair in degrees.

    Its hash (the generated one's value, ``hash((lat, lon))``) is computed once: every
    tier looks distances and RTT estimates up by pairs of points per request and child."""

    lat: float
    lon: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.lat, self.lon)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=16_384)
def great_circle_km(a: GeoPoint, b: GeoPoint) -> float:
    """Haversine distance between two points, in kilometres.

    Every tier's picker asks it per request and child, and requests come from a
    bounded set of places (cities, declared regions), so the answers are kept."""
    phi1, phi2 = math.radians(a.lat), math.radians(b.lat)
    dphi = phi2 - phi1
    dlmb = math.radians(b.lon - a.lon)
    h = math.sin(dphi / 2) ** 2 + math.cos(phi1) * math.cos(phi2) * math.sin(dlmb / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def rtt_estimate_ms(a: GeoPoint, b: GeoPoint) -> float:
    """Round-trip time estimate from distance: there and back over stretched fibre."""
    return 2 * ROUTE_STRETCH * great_circle_km(a, b) / FIBRE_KM_PER_MS


def parse_geo(text: str) -> GeoPoint:
    """Parse ``"lat,lon"`` in degrees; raise ``ValueError`` saying what is wrong."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"expected 'lat,lon' in degrees, got {text!r}")
    try:
        lat, lon = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"expected 'lat,lon' in degrees, got {text!r}") from None
    if not (math.isfinite(lat) and math.isfinite(lon)) or not (
        -90 <= lat <= 90 and -180 <= lon <= 180
    ):
        raise ValueError(f"lat must be in [-90, 90] and lon in [-180, 180], got {text!r}")
    return GeoPoint(lat, lon)


def format_geo(point: GeoPoint) -> str:
    return f"{point.lat:.4f},{point.lon:.4f}"
