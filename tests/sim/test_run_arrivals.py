"""sim.run's arrivals: a run is as many requests as it asks for, at the scenario's rate."""

from __future__ import annotations

from common.config.topology import topology_from_mapping
from sim.fleet_gen import fleet_mapping
from sim.run import Geography, RunSpec, _arrivals, arrival_rate
from sim.scenarios import SCENARIOS
from sim.shapes import CONVERSATION
from sim.workload import WorkloadSpec


def test_a_run_longer_than_a_minute_of_arrivals_gets_all_its_requests() -> None:
    topology = topology_from_mapping(fleet_mapping(gpus=4, regions=1, seed=1))
    steady = next(s for s in SCENARIOS if s.name == "steady-50")
    spec = RunSpec(topology, WorkloadSpec(shape=CONVERSATION, seed=1), steady, "meridian", 1200)
    rate = arrival_rate(spec)
    assert 1200 / rate > 90  # four GPUs at half load: far more than 60 s of arrivals
    requests, duration = _arrivals(spec, Geography(topology))
    times = [r.at_s for r in requests]
    assert len(times) == 1200
    assert duration == 1200 / rate
    assert times[-1] > 60
    assert abs(times[-1] - duration) < 0.25 * duration  # arriving at about the rate asked
