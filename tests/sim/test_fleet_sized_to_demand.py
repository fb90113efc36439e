"""A generated fleet sized to demand: each region's GPUs follow the peak over a day of
its clients' share of the traffic, the total is kept, and the default is unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from sim.fleet_gen import apportion, fleet_mapping, region_weights
from sim.geography import CITIES, CLOUD_REGIONS
from sim.regional_load import day_peak_shares


def per_region(mapping: dict[str, Any]) -> dict[str, int]:
    return {r["name"]: sum(len(z["gpus"]) for z in r["zones"]) for r in mapping["regions"]}


@pytest.mark.parametrize(("gpus", "regions"), [(1024, 6), (48, 3), (200, 12)])
def test_the_split_follows_the_peaks_and_keeps_the_total(gpus: int, regions: int) -> None:
    chosen = CLOUD_REGIONS[:regions]
    peaks = day_peak_shares(CITIES, {r.name: r.location for r in chosen})
    sized = per_region(fleet_mapping(gpus=gpus, regions=regions, seed=1, sized_to_demand=True))
    assert sum(sized.values()) == gpus
    assert list(sized.values()) == apportion(gpus, [peaks[r.name] for r in chosen], minimum=1)
    ranked = sorted(sized, key=lambda r: peaks[r])
    assert [sized[r] for r in ranked] == sorted(sized.values())  # more peak, more GPUs


def test_the_split_is_proportional_within_a_gpu() -> None:
    chosen = CLOUD_REGIONS[:6]
    peaks = day_peak_shares(CITIES, {r.name: r.location for r in chosen})
    sized = per_region(fleet_mapping(gpus=1024, regions=6, seed=1, sized_to_demand=True))
    rest = 1024 - len(chosen)
    for name, count in sized.items():
        assert abs(count - 1 - rest * peaks[name] / sum(peaks.values())) < 1, name


def test_the_default_fleet_is_split_by_gpu_weight() -> None:
    assert region_weights(CLOUD_REGIONS[:6], False) == [r.gpu_weight for r in CLOUD_REGIONS[:6]]
    default = per_region(fleet_mapping(gpus=1024, regions=6, seed=1))
    assert list(default.values()) == apportion(
        1024, [r.gpu_weight for r in CLOUD_REGIONS[:6]], minimum=1
    )


def test_sizing_moves_only_gpus_between_regions() -> None:
    """Same hardware mix and throttled count, same zones per region, same for a seed."""
    a = fleet_mapping(gpus=256, regions=6, seed=4, sized_to_demand=True)
    b = fleet_mapping(gpus=256, regions=6, seed=4)
    gpus_a = [g for r in a["regions"] for z in r["zones"] for g in z["gpus"]]
    gpus_b = [g for r in b["regions"] for z in r["zones"] for g in z["gpus"]]
    assert sorted(g["hardware"] for g in gpus_a) == sorted(g["hardware"] for g in gpus_b)
    assert sum("throttle" in g for g in gpus_a) == sum("throttle" in g for g in gpus_b)
    assert a == fleet_mapping(gpus=256, regions=6, seed=4, sized_to_demand=True)
