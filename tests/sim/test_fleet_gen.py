"""Generated fleets: they parse as topologies, hold what was asked (GPUs, regions at
their real places, 2-3 zones, the hardware mix, 5% throttled), are the same for a
seed, and every bad flag says what to fix."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.basics.geo import GeoPoint, great_circle_km
from common.config.topology import Topology, load_topology, topology_from_mapping
from sim.fleet_gen import fleet_mapping, parse_hardware_mix, write_fleet
from sim.geography import CITIES, CLOUD_REGIONS

# Where the regions' metros are (latitude, longitude of the city centre).
METROS = {
    "us-east": (38.9, -77.0),  # Washington DC / Northern Virginia
    "eu-west": (53.35, -6.26),  # Dublin
    "ap-southeast": (1.29, 103.85),  # Singapore
    "us-west": (45.84, -119.70),  # Boardman, Oregon
    "eu-central": (50.11, 8.68),  # Frankfurt
    "ap-northeast": (35.68, 139.69),  # Tokyo
    "ap-south": (19.08, 72.88),  # Mumbai
    "sa-east": (-23.55, -46.63),  # São Paulo
    "au-southeast": (-33.87, 151.21),  # Sydney
    "ca-central": (45.50, -73.57),  # Montréal
    "af-south": (-33.92, 18.42),  # Cape Town
    "me-central": (25.20, 55.27),  # Dubai
}


def fleet(gpus: int = 1024, regions: int = 6, seed: int = 1, **kw: Any) -> Topology:
    return topology_from_mapping(fleet_mapping(gpus=gpus, regions=regions, seed=seed, **kw))


def all_gpus(topo: Topology) -> list[Any]:
    return [g for r in topo.regions for z in r.zones for g in z.gpus]


@pytest.mark.parametrize(("gpus", "regions"), [(1024, 6), (100, 8), (7, 3), (2, 1), (5000, 12)])
def test_the_fleet_has_the_asked_gpus_regions_and_2_to_3_zones_each(
    gpus: int, regions: int
) -> None:
    topo = fleet(gpus, regions)
    assert len(all_gpus(topo)) == gpus
    assert [r.name for r in topo.regions] == [r.name for r in CLOUD_REGIONS[:regions]]
    for region in topo.regions:
        held = sum(len(z.gpus) for z in region.zones)
        assert all(z.gpus for z in region.zones)
        assert min(2, held) <= len(region.zones) <= 3
    assert topo.models == {"sim-llm"}


def test_regions_stand_at_their_metros_and_zones_near_their_region() -> None:
    topo = fleet(gpus=600, regions=len(CLOUD_REGIONS))
    for region in topo.regions:
        assert great_circle_km(region.location, GeoPoint(*METROS[region.name])) < 100, region.name
        for zone in region.zones:
            assert 1 < great_circle_km(zone.location, region.location) < 50, zone.name
    assert len(CLOUD_REGIONS) >= 8


def test_six_regions_cover_the_americas_europe_and_asia_twice() -> None:
    lons = [r.location.lon for r in fleet(gpus=60, regions=6).regions]
    assert sum(lon < -30 for lon in lons) == 2
    assert sum(-30 <= lon < 40 for lon in lons) == 2
    assert sum(lon >= 60 for lon in lons) == 2


def test_the_big_us_and_eu_regions_hold_the_most_gpus() -> None:
    topo = fleet()
    held = {r.name: sum(len(z.gpus) for z in r.zones) for r in topo.regions}
    asia = max(held["ap-southeast"], held["ap-northeast"])
    assert min(held["us-east"], held["eu-west"], held["us-west"], held["eu-central"]) > asia
    assert held["us-east"] == max(held.values())


def test_the_hardware_mix_is_exact_and_spread_over_zones() -> None:
    topo = fleet(gpus=1000, regions=6)
    assert Counter(g.hardware for g in all_gpus(topo)) == {
        "V100": 100,
        "A100": 400,
        "H100": 400,
        "H200": 100,
    }
    for region in topo.regions:
        for zone in region.zones:
            assert len({g.hardware for g in zone.gpus}) >= 3, zone.name
    custom = fleet(gpus=10, regions=2, hardware_mix={"H100": 3, "A100": 1})
    assert Counter(g.hardware for g in all_gpus(custom)) == {"H100": 8, "A100": 2}


@pytest.mark.parametrize(("gpus", "throttled"), [(1024, 51), (1000, 50), (10, 1), (9, 0), (30, 2)])
def test_five_percent_rounded_of_the_gpus_are_throttled_to_0_8(gpus: int, throttled: int) -> None:
    slow = [g for g in all_gpus(fleet(gpus, 1)) if g.throttle != 1.0]
    assert len(slow) == throttled
    assert all(g.throttle == 0.8 for g in slow)
    none = fleet(gpus=50, regions=2, throttled_fraction=0.0)
    assert all(g.throttle == 1.0 for g in all_gpus(none))


def test_max_concurrency_fits_a_batch_of_conversation_shaped_requests_in_kv_cache() -> None:
    reservation = 1155 + 211  # the conversation trace's mean prompt + mean output
    seen = set()
    for gpu in all_gpus(fleet(gpus=200, regions=2)):
        assert gpu.max_concurrency * reservation <= gpu.kv_cache_tokens
        assert (gpu.max_concurrency + 1) * reservation > gpu.kv_cache_tokens
        seen.add((gpu.hardware, gpu.max_concurrency))
    assert seen == {("V100", 11), ("A100", 47), ("H100", 59), ("H200", 95)}


def test_the_same_seed_gives_the_same_fleet_and_another_seed_another() -> None:
    one = fleet_mapping(gpus=300, regions=4, seed=3)
    assert one == fleet_mapping(gpus=300, regions=4, seed=3)
    assert one != fleet_mapping(gpus=300, regions=4, seed=4)


def test_every_address_is_any_loopback_port_and_there_is_no_auth() -> None:
    mapping = fleet_mapping(gpus=20, regions=2, seed=1)
    topo = topology_from_mapping(mapping)
    assert {str(e) for e in topo.endpoints()} == {"127.0.0.1:0"}
    assert "auth" not in mapping
    assert not topo.auth.enabled


def test_write_fleet_writes_topology_yaml_with_a_header(tmp_path: Path) -> None:
    mapping = fleet_mapping(gpus=64, regions=3, seed=2)
    path = tmp_path / "fleet.yaml"
    write_fleet(path, mapping)
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header and text.startswith("# ")
    assert "64 GPUs in 3 regions" in " ".join(header)
    assert yaml.safe_load(text) == mapping
    assert len(all_gpus(load_topology(path))) == 64


def test_cities_are_spread_over_the_world_with_traffic_weights() -> None:
    assert len(CITIES) >= 24
    assert len({c.name for c in CITIES}) == len(CITIES)
    assert all(c.weight > 0 and -12 <= c.utc_offset_h <= 14 for c in CITIES)
    # Longitude and UTC offset agree within the usual few hours (time zones follow the sun).
    for city in CITIES:
        assert abs(city.location.lon / 15 - city.utc_offset_h) < 3.5, city.name
    southern = sum(c.location.lat < 0 for c in CITIES)
    assert southern >= 4


BAD_FLAGS: list[tuple[dict[str, Any], str]] = [
    ({"gpus": 0}, "--gpus must be at least 1, got 0"),
    ({"gpus": True}, "--gpus must be at least 1, got True"),
    ({"regions": 0}, f"--regions must be between 1 and {len(CLOUD_REGIONS)}, got 0"),
    ({"regions": 13}, f"--regions must be between 1 and {len(CLOUD_REGIONS)}, got 13"),
    (
        {"gpus": 4, "regions": 6},
        "--regions 6 needs at least 6 GPUs (one per region), got --gpus 4; lower --regions",
    ),
    ({"model": ""}, "--model must be a model name without '@version', got ''"),
    ({"model": "m@2"}, "--model must be a model name without '@version', got 'm@2'"),
    ({"throttled_fraction": 1.5}, "--throttled-fraction must be between 0 and 1, got 1.5"),
    (
        {"hardware_mix": {"B200": 1.0}},
        "--hardware-mix: unknown hardware class 'B200'; known: A100, H100, H200, V100",
    ),
    ({"hardware_mix": {"A100": -1.0}}, "--hardware-mix: A100 must be a fraction >= 0, got -1.0"),
    ({"hardware_mix": {"A100": math.nan}}, "--hardware-mix: A100 must be a fraction >= 0"),
    ({"hardware_mix": {"A100": 0.0}}, "--hardware-mix: the fractions sum to 0"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_FLAGS, ids=[m for _, m in BAD_FLAGS])
def test_a_bad_flag_says_what_to_fix(overrides: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"gpus": 100, "regions": 6, "seed": 1, **overrides}
    with pytest.raises(ValueError) as info:
        fleet_mapping(**args)
    assert message in str(info.value)


def test_parse_hardware_mix_reads_pairs_and_refuses_anything_else() -> None:
    assert parse_hardware_mix("V100=0.1, A100=0.9") == {"V100": 0.1, "A100": 0.9}
    for text in ("V100", "V100=x", "=0.5", "V100=0.1,,A100=1"):
        with pytest.raises(ValueError, match="--hardware-mix: expected CLASS=FRACTION pairs"):
            parse_hardware_mix(text)
