import math

import pytest

from common.basics.geo import GeoPoint, great_circle_km, parse_geo, rtt_estimate_ms

DUBLIN = GeoPoint(53.35, -6.26)
SINGAPORE = GeoPoint(1.29, 103.85)
ASHBURN = GeoPoint(39.04, -77.49)
LONDON = GeoPoint(51.51, -0.13)


@pytest.mark.parametrize(
    ("a", "b", "km"),
    [
        (DUBLIN, DUBLIN, 0.0),
        (LONDON, DUBLIN, 464.0),
        (ASHBURN, DUBLIN, 5_470.0),
        (DUBLIN, SINGAPORE, 11_210.0),
        (GeoPoint(0, 0), GeoPoint(0, 180), math.pi * 6371.0),
    ],
)
def test_great_circle_distance(a: GeoPoint, b: GeoPoint, km: float) -> None:
    assert great_circle_km(a, b) == pytest.approx(km, rel=0.02, abs=1.0)


def test_distance_is_symmetric() -> None:
    assert great_circle_km(DUBLIN, SINGAPORE) == pytest.approx(great_circle_km(SINGAPORE, DUBLIN))


def test_rtt_grows_with_distance() -> None:
    assert rtt_estimate_ms(DUBLIN, LONDON) < rtt_estimate_ms(DUBLIN, ASHBURN)
    assert rtt_estimate_ms(DUBLIN, DUBLIN) == 0.0


@pytest.mark.parametrize(
    ("text", "point"),
    [("53.35,-6.26", DUBLIN), (" 1.29 , 103.85 ", SINGAPORE), ("-90,180", GeoPoint(-90, 180))],
)
def test_parse_geo_accepts(text: str, point: GeoPoint) -> None:
    assert parse_geo(text) == point


@pytest.mark.parametrize("text", ["", "53.35", "a,b", "1,2,3", "91,0", "0,181", "nan,0", "inf,1"])
def test_parse_geo_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_geo(text)


def test_a_point_hashes_as_its_coordinates_and_stays_immutable() -> None:
    import dataclasses
    import pickle

    p = GeoPoint(51.5, -0.12)
    # The value the generated dataclass hash had (sets and dicts of points keep their order).
    assert hash(p) == hash((51.5, -0.12)) == hash(GeoPoint(51.5, -0.12))
    assert hash(pickle.loads(pickle.dumps(p))) == hash(p)
    moved = dataclasses.replace(p, lat=48.85)
    assert hash(moved) == hash((48.85, -0.12)) and moved != p
    assert dataclasses.asdict(p) == {"lat": 51.5, "lon": -0.12}
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.lat = 0.0  # type: ignore[misc]
