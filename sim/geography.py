"""Where a simulated fleet stands and where its clients are: cloud regions and cities.

``CLOUD_REGIONS`` are real cloud regions at their metro's coordinates, ordered so
that the first N make a sensible N-region fleet: 3 covers the Americas, Europe
and Asia once; 6 covers each of them twice (us-east, eu-west, ap-southeast,
us-west, eu-central, ap-northeast); later ones add India, South America,
Oceania, Canada, Africa and the Middle East. ``gpu_weight`` is a region's share of
a generated fleet's GPUs (``sim.fleet_gen``): the big US and EU regions hold the
most, as they do at every large provider.

``CITIES`` are where the simulated clients are. ``weight`` is a city's share of
requests, roughly its metro area's internet users in millions (rounded figures:
the simulator needs a plausible spread, not a census); ``utc_offset_h`` is its
standard time (daylight saving is ignored), used for the diurnal curve
(``sim.arrivals``).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.basics.geo import GeoPoint

# Availability zones sit in separate data-centre clusters ~10-20 km apart: these
# offsets (degrees of latitude, longitude) place zone i of a region near it.
ZONE_OFFSETS_DEG: tuple[tuple[float, float], ...] = ((0.08, -0.10), (-0.09, 0.07), (0.03, 0.15))


@dataclass(frozen=True)
class CloudRegion:
    """A cloud region: its name, its metro's coordinates and its zones' suffixes."""

    name: str
    location: GeoPoint
    zone_suffixes: tuple[str, ...]
    metro: str = ""
    gpu_weight: float = 1.0

    def zone_name(self, index: int) -> str:
        return f"{self.name}-{self.zone_suffixes[index]}"

    def zone_location(self, index: int) -> GeoPoint:
        dlat, dlon = ZONE_OFFSETS_DEG[index % len(ZONE_OFFSETS_DEG)]
        return GeoPoint(round(self.location.lat + dlat, 4), round(self.location.lon + dlon, 4))


@dataclass(frozen=True)
class City:
    """Where clients are: a metro, its standard UTC offset and its share of traffic."""

    name: str
    location: GeoPoint
    utc_offset_h: float
    weight: float


_ABC = ("1a", "1b", "1c")

CLOUD_REGIONS: tuple[CloudRegion, ...] = (
    CloudRegion("us-east", GeoPoint(39.04, -77.49), _ABC, "N. Virginia", 3.0),
    CloudRegion("eu-west", GeoPoint(53.35, -6.26), _ABC, "Ireland", 2.5),
    CloudRegion("ap-southeast", GeoPoint(1.29, 103.85), _ABC, "Singapore", 1.5),
    CloudRegion("us-west", GeoPoint(45.84, -119.70), _ABC, "Oregon", 2.5),
    CloudRegion("eu-central", GeoPoint(50.11, 8.68), _ABC, "Frankfurt", 2.0),
    CloudRegion("ap-northeast", GeoPoint(35.68, 139.69), _ABC, "Tokyo", 1.5),
    CloudRegion("ap-south", GeoPoint(19.08, 72.88), _ABC, "Mumbai", 1.0),
    CloudRegion("sa-east", GeoPoint(-23.55, -46.63), _ABC, "São Paulo", 1.0),
    CloudRegion("au-southeast", GeoPoint(-33.87, 151.21), _ABC, "Sydney", 1.0),
    CloudRegion("ca-central", GeoPoint(45.50, -73.57), _ABC, "Montréal", 1.0),
    CloudRegion("af-south", GeoPoint(-33.92, 18.42), _ABC, "Cape Town", 0.5),
    CloudRegion("me-central", GeoPoint(25.20, 55.27), _ABC, "UAE", 0.75),
)

CITIES: tuple[City, ...] = (
    # The Americas
    City("New York", GeoPoint(40.71, -74.01), -5, 18),
    City("Los Angeles", GeoPoint(34.05, -118.24), -8, 12),
    City("Chicago", GeoPoint(41.88, -87.63), -6, 8),
    City("Dallas", GeoPoint(32.78, -96.80), -6, 7),
    City("San Francisco", GeoPoint(37.77, -122.42), -8, 7),
    City("Toronto", GeoPoint(43.65, -79.38), -5, 6),
    City("Mexico City", GeoPoint(19.43, -99.13), -6, 14),
    City("Bogotá", GeoPoint(4.71, -74.07), -5, 8),
    City("São Paulo", GeoPoint(-23.55, -46.63), -3, 18),
    City("Buenos Aires", GeoPoint(-34.60, -58.38), -3, 12),
    # Europe, Africa, the Middle East
    City("London", GeoPoint(51.51, -0.13), 0, 13),
    City("Paris", GeoPoint(48.86, 2.35), 1, 11),
    City("Berlin", GeoPoint(52.52, 13.40), 1, 5),
    City("Madrid", GeoPoint(40.42, -3.70), 1, 6),
    City("Istanbul", GeoPoint(41.01, 28.98), 3, 13),
    City("Lagos", GeoPoint(6.52, 3.38), 1, 10),
    City("Cairo", GeoPoint(30.04, 31.24), 2, 12),
    City("Johannesburg", GeoPoint(-26.20, 28.05), 2, 7),
    City("Dubai", GeoPoint(25.20, 55.27), 4, 3),
    # Asia and Oceania
    City("Mumbai", GeoPoint(19.08, 72.88), 5.5, 18),
    City("Delhi", GeoPoint(28.61, 77.21), 5.5, 24),
    City("Bangalore", GeoPoint(12.97, 77.59), 5.5, 11),
    City("Singapore", GeoPoint(1.35, 103.82), 8, 5),
    City("Jakarta", GeoPoint(-6.21, 106.85), 7, 25),
    City("Bangkok", GeoPoint(13.76, 100.50), 7, 10),
    City("Manila", GeoPoint(14.60, 120.98), 8, 15),
    City("Shanghai", GeoPoint(31.23, 121.47), 8, 25),
    City("Seoul", GeoPoint(37.57, 126.98), 9, 24),
    City("Tokyo", GeoPoint(35.68, 139.69), 9, 35),
    City("Sydney", GeoPoint(-33.87, 151.21), 10, 5),
)


def city_named(name: str, cities: tuple[City, ...] = CITIES) -> City:
    """The city called ``name``; ``ValueError`` listing the known ones otherwise."""
    for city in cities:
        if city.name == name:
            return city
    raise ValueError(f"unknown city {name!r}; known: {', '.join(c.name for c in cities)}")
