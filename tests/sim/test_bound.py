"""The lower bound bounds every policy on every request, and its formula case by case.

A bound that a policy beats on one request is no bound: each policy's run here
keeps every request's fate (a recorder of this file), and each served request's
TTFT and e2e must be at least the bound's for that request (a failed one is
infinitely late, so it never beats it).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from common.basics.geo import GeoPoint, rtt_estimate_ms
from common.config.topology import Topology, topology_from_mapping
from sim.bound import LowerBound
from sim.engine import step_cost_s
from sim.fleet_gen import fleet_mapping
from sim.measure import Recorder, Slo
from sim.requests import SimRequest
from sim.run import Geography, RunSpec, run_with_events, scenario_workload
from sim.scenarios import scenario
from sim.workload import WorkloadSpec, generate


class KeepingRecorder(Recorder):
    """A recorder that also keeps each request's latencies (None: it failed)."""

    def __init__(self) -> None:
        super().__init__(slo=Slo())
        self.seen: dict[int, tuple[float, float] | None] = {}

    def served(self, req: SimRequest, **kw: Any) -> None:
        self.seen[req.id] = (kw["ttft_s"], kw["e2e_s"])
        super().served(req, **kw)

    def failed(self, req: SimRequest, **kw: Any) -> None:
        self.seen[req.id] = None
        super().failed(req, **kw)


def quick_fleet() -> Topology:
    return topology_from_mapping(fleet_mapping(gpus=24, regions=3, seed=1))


@pytest.mark.parametrize(
    ("policy", "scenario_name"),
    [
        ("meridian", "steady-90"),
        ("greedy_clairvoyant", "steady-90"),
        ("nginx_least_conn_spill", "steady-90"),
        ("round_robin", "steady-90"),
        ("meridian", "zone-then-region-lost"),
    ],
)
def test_no_policy_beats_the_bound_on_any_request(policy: str, scenario_name: str) -> None:
    spec = RunSpec(
        topology=quick_fleet(),
        workload=WorkloadSpec(seed=4),
        scenario=scenario(scenario_name),
        policy=policy,
        requests=800,
        seed=4,
    )
    recorder = KeepingRecorder()
    run_with_events(spec, recorder=recorder)
    bound = LowerBound(spec.topology, rtt_estimate_ms)
    arrivals = list(generate(scenario_workload(spec, Geography(spec.topology))))
    assert len(recorder.seen) == len(arrivals) == 800  # nothing lost
    served = 0
    for req in arrivals:
        fate = recorder.seen[req.id]
        if fate is None:
            continue
        served += 1
        floor = bound.latency(req)
        assert fate[0] >= floor.ttft_s - 1e-9, (req, fate, floor)
        assert fate[1] >= floor.e2e_s - 1e-9, (req, fate, floor)
    assert served > 700


def test_the_bound_row_is_at_or_below_every_policy_percentile() -> None:
    base = RunSpec(
        topology=quick_fleet(),
        workload=WorkloadSpec(seed=2),
        scenario=scenario("steady-90"),
        policy="bound",
        requests=600,
        seed=2,
    )
    floor, _ = run_with_events(base)
    mine, _ = run_with_events(replace(base, policy="meridian"))
    assert floor.served == floor.offered == mine.offered
    for name in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s"):
        assert getattr(floor, name) <= getattr(mine, name)
    # The bound simulates no GPU: no utilisation to speak of.
    assert floor.gpus == 0 and floor.util_mean is None


def two_region_fleet() -> Topology:
    def region(name: str, lat: float, hardware: str, model: str) -> dict[str, Any]:
        return {
            "name": name,
            "location": {"lat": lat, "lon": 0.0},
            "listen": "127.0.0.1:0",
            "zones": [
                {
                    "name": f"{name}-a",
                    "listen": "127.0.0.1:0",
                    "gpus": [
                        {
                            "name": f"{name}-g",
                            "hardware": hardware,
                            "models": [model],
                            "listen": "127.0.0.1:0",
                        }
                    ],
                }
            ],
        }

    return topology_from_mapping(
        {
            "redis_url": "redis://127.0.0.1:1/0",
            "global": {"listen": "127.0.0.1:1", "location": {"lat": 0.0, "lon": 0.0}},
            "regions": [
                region("near", 1.0, "V100", "m"),
                region("far", 40.0, "H100", "m"),
                region("other", 0.5, "H200", "n"),
            ],
        }
    )


def request(**kw: Any) -> SimRequest:
    fields: dict[str, Any] = {
        "id": 0,
        "at_s": 0.0,
        "city": "c",
        "origin": GeoPoint(0.0, 0.0),
        "tenant": "t",
        "prompt_tokens": 320,
        "output_tokens": 50,
        "model": "m",
        "max_tokens": 1000,
        "prefix_blocks": tuple(range(20)),
    }
    fields.update(kw)
    return SimRequest(**fields)


def test_the_bound_takes_the_nearest_region_and_the_fastest_gpu_serving_the_model() -> None:
    fleet = two_region_fleet()
    bound = LowerBound(fleet, rtt_estimate_ms)
    floor = bound.latency(request())
    # Nearest region serving "m" is "near" ("other" serves "n" only); the fastest GPU
    # serving "m" is the H100 in "far", wherever it is: the two floors are apart.
    h100 = fleet.regions[1].zones[0].gpus[0].speed
    rtt = rtt_estimate_ms(GeoPoint(0.0, 0.0), GeoPoint(1.0, 0.0)) / 1000.0
    assert floor.region == "near"
    assert floor.ttft_s == pytest.approx(rtt + step_cost_s(1, 320) / h100)
    assert floor.e2e_s == pytest.approx(floor.ttft_s + 49 * step_cost_s(1, 0) / h100)


def test_only_the_shared_prefix_counts_as_cached_and_never_more_than_the_prompt() -> None:
    bound = LowerBound(two_region_fleet(), rtt_estimate_ms)
    cold = bound.latency(request())
    warm = bound.latency(request(shared_blocks=10))  # 160 of the 320 tokens
    whole = bound.latency(request(shared_blocks=40))  # more blocks than the prompt has
    h100 = two_region_fleet().regions[1].zones[0].gpus[0].speed
    saved = (step_cost_s(1, 320) - step_cost_s(1, 160)) / h100
    assert cold.ttft_s - warm.ttft_s == pytest.approx(saved)
    assert whole.ttft_s == pytest.approx(
        cold.ttft_s - (step_cost_s(1, 320) - step_cost_s(1, 0)) / h100
    )


def test_the_bound_knows_the_true_length_not_the_cap() -> None:
    bound = LowerBound(two_region_fleet(), rtt_estimate_ms)
    assert bound.latency(request(max_tokens=4000)) == bound.latency(request(max_tokens=60))
    assert bound.latency(request(output_tokens=1)).e2e_s == bound.latency(request()).ttft_s


def test_a_model_no_gpu_serves_has_no_bound() -> None:
    bound = LowerBound(two_region_fleet(), rtt_estimate_ms)
    assert not bound.serves("missing") and bound.serves("n")
    with pytest.raises(KeyError):
        bound.latency(request(model="missing"))
    assert math.isfinite(bound.latency(request(model="n")).e2e_s)
