"""sim.regional_load: each region's offered load ÷ capacity over a run, from the workload
alone. A compressed day moves every region's peak through the run while the fleet
stays at the scenario's load; a steady scenario is flat; the figures agree with the
arrivals the simulator draws."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from common.config.topology import Topology, topology_from_mapping
from sim.fleet_gen import fleet_mapping
from sim.regional_load import RegionalLoad, day_peak_shares, nearest_region, regional_load
from sim.run import Geography, RunSpec, scenario_workload
from sim.scenarios import SCENARIOS, scenario
from sim.workload import WorkloadSpec, generate

# The Mixer normalises the cities' shares at every step, so outside boosts the fleet's
# offered rate is the scenario's rate at every instant: only float rounding separates
# the computed fleet-wide ratio from the load.
EXACT = 1e-9


def fleet(gpus: int = 1024, regions: int = 6) -> Topology:
    return topology_from_mapping(fleet_mapping(gpus=gpus, regions=regions, seed=1))


def load_of(name: str, topology: Topology, requests: int = 200_000) -> RegionalLoad:
    spec = RunSpec(topology, WorkloadSpec(seed=1), scenario(name), "meridian", requests)
    workload = scenario_workload(spec, Geography(topology))
    return regional_load(workload, topology, requests / workload.rate_rps)


@pytest.fixture(scope="module")
def day() -> RegionalLoad:
    return load_of("day-90", fleet())


def test_the_day_scenarios_are_compressed_days_and_the_steady_ones_are_not() -> None:
    days = {s.name for s in SCENARIOS if s.compressed_day}
    assert days == {"day-70", "day-90"}
    assert scenario("day-90").load == 0.9 and not scenario("steady-90").compressed_day


def test_a_compressed_day_spans_the_run_from_midnight() -> None:
    topology = fleet()
    spec = RunSpec(topology, WorkloadSpec(seed=1), scenario("day-90"), "meridian", 200_000)
    workload = scenario_workload(spec, Geography(topology))
    assert workload.start_utc_hour == 0.0
    assert workload.day_length_s == pytest.approx(200_000 / workload.rate_rps)
    steady = scenario_workload(
        RunSpec(topology, WorkloadSpec(seed=1), scenario("steady-90"), "meridian", 200_000),
        Geography(topology),
    )
    assert (steady.start_utc_hour, steady.day_length_s) == (12.0, 86_400.0)


def test_each_region_peaks_at_its_own_time_of_the_compressed_day(day: RegionalLoad) -> None:
    peaks = day.peak_at_s
    assert len(set(peaks.values())) == len(peaks)
    # Local evenings pass east to west: Tokyo's, Singapore's, Frankfurt's, then the US's
    # (late in the run, or for Oregon just past midnight UTC, at its start).
    assert peaks["ap-northeast"] < peaks["ap-southeast"] < peaks["eu-central"] < peaks["us-east"]
    for name, values in day.series.items():
        assert max(values) > 1.4 * min(values), name  # the curve really moves each region


def test_the_fleet_stays_at_the_load_at_every_point_of_the_day(day: RegionalLoad) -> None:
    assert day.fleet_mean == pytest.approx(0.9, rel=EXACT)
    total = sum(day.capacity_rps.values())
    for i in range(len(next(iter(day.series.values())))):
        offered = sum(day.series[r][i] * day.capacity_rps[r] for r in day.series)
        assert offered / total == pytest.approx(0.9, rel=EXACT), i


def test_a_steady_scenario_holds_each_region_where_noon_utc_puts_it() -> None:
    steady = load_of("steady-90", fleet())
    for name, values in steady.series.items():
        assert max(values) == pytest.approx(min(values), rel=EXACT), name
        assert steady.peak[name] == pytest.approx(values[0], rel=EXACT)
    assert steady.fleet_mean == pytest.approx(0.9, rel=EXACT)


def test_a_flash_crowd_raises_the_total_over_its_window() -> None:
    crowd = load_of("flash-crowd", fleet(48, 3), requests=20_000)
    assert crowd.fleet_mean > 0.6
    assert max(crowd.peak.values()) > 1.0


def test_the_figures_match_the_arrivals_the_simulator_draws() -> None:
    """Each region's share of the arrivals in each eighth of a compressed day, counted on
    the generated stream, within 0.03 of the computed share: ~2 500 arrivals per
    eighth put a binomial share's standard deviation at most 0.01."""
    topology, requests = fleet(48, 3), 20_000
    spec = RunSpec(topology, WorkloadSpec(seed=3), scenario("day-70"), "meridian", requests)
    workload = scenario_workload(spec, Geography(topology))
    load = regional_load(workload, topology, requests / workload.rate_rps, points=8)
    locations = {r.name: r.location for r in topology.regions}
    counts = [Counter[str]() for _ in range(8)]
    eighth = load.duration_s / 8
    for req in itertools.islice(generate(workload), requests):
        counts[min(int(req.at_s / eighth), 7)][nearest_region(req.origin, locations)] += 1
    for i, seen in enumerate(counts):
        n = sum(seen.values())
        offered = {r: load.series[r][i] * load.capacity_rps[r] for r in load.series}
        for region, rate in offered.items():
            assert seen[region] / n == pytest.approx(rate / sum(offered.values()), abs=0.03)


def test_day_peak_shares_are_shares_that_peak_apart() -> None:
    regions = {r.name: r.location for r in fleet().regions}
    peaks = day_peak_shares(WorkloadSpec().cities, regions)
    assert set(peaks) == set(regions)
    assert all(0 < p <= 1 for p in peaks.values())
    assert sum(peaks.values()) > 1  # the regions' peaks do not coincide


def test_a_region_nearest_no_city_offers_nothing() -> None:
    regions = {r.name: r.location for r in fleet(24, 12).regions}
    peaks = day_peak_shares(WorkloadSpec().cities, regions)
    homes = {nearest_region(c.location, regions) for c in WorkloadSpec().cities}
    assert {r for r, p in peaks.items() if p == 0} == set(regions) - homes
    assert not math.isnan(sum(peaks.values()))


def test_bad_durations_are_refused() -> None:
    topology = fleet(8, 2)
    with pytest.raises(ValueError, match="duration_s > 0"):
        regional_load(WorkloadSpec(), topology, 0.0)
