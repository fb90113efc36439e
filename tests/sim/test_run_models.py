"""Any topology simulates: requests ask for the models it serves, and a run that serves
nothing, or asks for a model no GPU serves, fails naming the cause."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from common.config.topology import Topology, topology_from_mapping
from sim.run import RunSpec, run, workload_models
from sim.scenarios import FleetEvent, Scenario, scenario
from sim.workload import WorkloadSpec


def own_fleet(models: tuple[str, ...] = ("demo-llm",)) -> Topology:
    """A user's fleet: one region, its GPUs serving the user's own model names."""
    gpus = [
        {
            "name": f"g{i}",
            "hardware": "A100",
            "models": [models[i % len(models)]],
            "listen": "127.0.0.1:0",
        }
        for i in range(4)
    ]
    zone: dict[str, Any] = {"name": "z", "listen": "127.0.0.1:0", "gpus": gpus}
    return topology_from_mapping(
        {
            "redis_url": "redis://127.0.0.1:1/0",
            "global": {"listen": "127.0.0.1:1", "location": {"lat": 50.0, "lon": 8.0}},
            "regions": [
                {
                    "name": "r",
                    "location": {"lat": 50.0, "lon": 8.0},
                    "listen": "127.0.0.1:0",
                    "zones": [zone],
                }
            ],
        }
    )


def spec(topology: Topology, **kw: Any) -> RunSpec:
    base = RunSpec(
        topology=topology,
        workload=WorkloadSpec(seed=1),
        scenario=scenario("steady-70"),
        policy="meridian",
        requests=300,
    )
    return replace(base, **kw)


def test_a_topology_serving_its_own_model_name_is_served() -> None:
    result = run(spec(own_fleet()))
    assert result.offered > 250 and result.served > 0.9 * result.offered


def test_requests_spread_over_the_served_models_by_gpu_count() -> None:
    assert workload_models((), own_fleet(("a", "a", "a", "b"))) == (("a", 3.0), ("b", 1.0))
    result = run(spec(own_fleet(("a", "b"))))
    assert result.served > 0.9 * result.offered


def test_a_model_no_gpu_serves_fails_naming_it_and_what_is_served() -> None:
    asked = replace(WorkloadSpec(seed=1), models=(("llama", 1.0),))
    with pytest.raises(ValueError, match=r"model 'llama', which no GPU .* serves: demo-llm"):
        run(spec(own_fleet(), workload=asked))


def test_a_policy_that_serves_nothing_fails_the_run_naming_it() -> None:
    # The one region is lost before the first request arrives.
    gone = Scenario("gone", "the only region lost at once", 0.5, (FleetEvent(0.0, "lose_region"),))
    with pytest.raises(
        RuntimeError,
        match=r"policy 'meridian' served none of the 300 requests in scenario 'gone' "
        r"\(UNAVAILABLE 300\)",
    ):
        run(spec(own_fleet(), scenario=gone, warmup_fraction=0.0))
