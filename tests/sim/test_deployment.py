"""The simulated deployment runs the servers' own decision code in simulated time.

A small fleet (two regions, two zones each) gets hand-made arrivals; a recorder
in this file keeps every request's fate, so a test can check that nothing was
lost, where requests went, and that a knob of the real code moves the result.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import pytest

from common.basics.geo import GeoPoint
from common.config.topology import Topology, topology_from_mapping
from global_lb.server import region_picker
from local_lb.policies import POLICIES
from local_lb.server import local_policy
from regional_lb.server import zone_picker
from sim.clock import run_simulated
from sim.deployment import SimDeployment
from sim.flow import RequestFlow
from sim.requests import SimRequest
from tests.cyclic import free_unreachable, request_leftovers, unreachable_now

EAST, WEST = GeoPoint(39.0, -77.5), GeoPoint(45.6, -121.2)
CITIES = (("washington", GeoPoint(38.9, -77.0)), ("portland", GeoPoint(45.5, -122.7)))


def fleet(gpus_per_zone: int = 4) -> Topology:
    hardware = ("A100", "H100", "V100", "A100")
    regions = []
    for r, (name, loc) in enumerate((("east", EAST), ("west", WEST))):
        zones = [
            {
                "name": f"{name}-{z}",
                "location": {"lat": loc.lat + 0.1 * z, "lon": loc.lon},
                "listen": "127.0.0.1:0",
                "gpus": [
                    {
                        "name": f"{name}-{z}-g{g}",
                        "hardware": hardware[(g + r) % 4],
                        "models": ["sim-llm"],
                        "max_concurrency": 8,
                        "listen": "127.0.0.1:0",
                    }
                    for g in range(gpus_per_zone)
                ],
            }
            for z in range(2)
        ]
        loc_map = {"lat": loc.lat, "lon": loc.lon}
        regions.append({"name": name, "location": loc_map, "listen": "127.0.0.1:0", "zones": zones})
    return topology_from_mapping(
        {
            "redis_url": "redis://127.0.0.1:1/0",
            "global": {"listen": "127.0.0.1:1", "location": {"lat": 40.7, "lon": -74.0}},
            "regions": regions,
        }
    )


@dataclass(frozen=True)
class Meridian:
    """The servers' own pickers at every tier (what sim.policies calls 'meridian')."""

    name: str = "meridian"
    local_policy: str = "default"

    @staticmethod
    def region_picker(topology: Topology, rng: random.Random) -> Any:
        return region_picker(topology, rng)

    @staticmethod
    def zone_picker(topology: Topology, region: Any, rng: random.Random) -> Any:
        return zone_picker(topology, region, rng)


class Recorder:
    """Keeps every request's fate as the flow reports it."""

    def __init__(self) -> None:
        self.ok: list[dict[str, Any]] = []
        self.lost: list[dict[str, Any]] = []

    def served(self, req: SimRequest, **fate: Any) -> None:
        self.ok.append({"id": req.id, "at": req.at_s, **fate})

    def failed(self, req: SimRequest, **fate: Any) -> None:
        self.lost.append({"id": req.id, "at": req.at_s, **fate})


def arrivals(n: int, rate: float, seed: int = 3) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        city, origin = CITIES[i % 2]
        shared = tuple(range(1000 * (i % 3), 1000 * (i % 3) + 16))  # three system prompts
        own = tuple(rng.getrandbits(60) for _ in range(rng.randint(1, 30)))
        blocks = shared + own
        out.append(
            SimRequest(
                i,
                t,
                city,
                origin,
                "t",
                16 * len(blocks),
                (length := rng.randint(10, 200)),
                blocks,
                max_tokens=length,
            )
        )
    return out


def simulate(
    requests: list[SimRequest],
    events: tuple[tuple[float, str], ...] = (),
    seed: int = 1,
    gpus_per_zone: int = 4,
) -> tuple[Recorder, SimDeployment]:
    async def main() -> tuple[Recorder, SimDeployment]:
        loop = asyncio.get_running_loop()
        from sim.deployment import SimSettings

        deployment = SimDeployment(fleet(gpus_per_zone), Meridian(), loop, SimSettings(seed=seed))
        recorder = Recorder()
        flow = RequestFlow(deployment, recorder)
        deployment.start()
        for at, what in events:
            loop.call_at(at, _lose, deployment, what)
        tasks = []
        for req in requests:
            await asyncio.sleep(max(0.0, req.at_s - loop.time()))
            tasks.append(loop.create_task(flow.serve(req)))
        await asyncio.gather(*tasks)
        deployment.stop()
        return recorder, deployment

    return run_simulated(main())


def started(loop: asyncio.AbstractEventLoop) -> tuple[SimDeployment, Recorder, RequestFlow]:
    """A started deployment of ``fleet(2)`` and a flow through it that records into a
    ``Recorder``: what the single-request tests below drive."""
    deployment = SimDeployment(fleet(2), Meridian(), loop)
    recorder = Recorder()
    flow = RequestFlow(deployment, recorder)
    deployment.start()
    return deployment, recorder, flow


def _lose(deployment: SimDeployment, what: str) -> None:
    """Take a zone or a region down: its tiers stop answering and its GPUs die."""
    if what in deployment.by_region:
        region = deployment.by_region[what]
        region.up = False
        zones = list(region.local.values())
    else:
        zones = [deployment.zones[what]]
    for zone in zones:
        zone.up = False
        for gpu in zone.gpus.values():
            gpu.fail("lost")


def test_every_request_is_served_once_and_latencies_are_real() -> None:
    requests = arrivals(600, rate=25.0)
    kept, deployment = simulate(requests)
    assert sorted(s["id"] for s in kept.ok) == [r.id for r in requests]
    assert not kept.lost
    # Clients near each region are mostly served there: the region picker leaves home
    # only when the other region's wait is less by more than the RTT it adds.
    home = sum(1 for s in kept.ok if s["region"] == s["home_region"])
    assert home > 0.6 * len(requests)
    # End-to-end covers prefill and decode on the GPU model plus the RTT.
    for s in kept.ok:
        assert s["e2e_s"] > s["ttft_s"] > s["rtt_ms"] / 1000
    # Summaries went up on the cadence and GPUs learned their rates.
    zone = next(iter(deployment.zones.values()))
    assert zone.publisher.published >= requests[-1].at_s / deployment.topology.summary_cadence_s
    assert all(c.summary is not None for c in deployment.regions)


def test_same_seed_same_outcome_and_another_seed_differs() -> None:
    requests = arrivals(300, rate=60.0)
    a, _ = simulate(requests, seed=1, gpus_per_zone=8)
    b, _ = simulate(requests, seed=1, gpus_per_zone=8)
    c, _ = simulate(requests, seed=2, gpus_per_zone=8)
    assert a.ok == b.ok
    assert [s["gpu"] for s in a.ok] != [s["gpu"] for s in c.ok]


def test_a_knob_of_the_real_picker_changes_the_simulated_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The local tier's cost (local_lb.cost.PREFILL_WEIGHT, read by the default picker
    on every pick) changed: the simulated placements change with it."""
    requests = arrivals(1500, rate=170.0)
    before, _ = simulate(requests, gpus_per_zone=8)
    monkeypatch.setattr("local_lb.cost.PREFILL_WEIGHT", 0.0)
    after, _ = simulate(requests, gpus_per_zone=8)
    moved = sum(1 for a, b in zip(before.ok, after.ok, strict=True) if a["gpu"] != b["gpu"])
    assert moved > 0.2 * len(requests)


def test_the_policy_the_servers_register_is_the_one_simulated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Register round robin under the default policy's name (local_lb.policies, which the
    local tier's server reads too): the simulated fleet then balances blind to load
    and speed, and its latency shows it."""
    requests = arrivals(3000, rate=170.0)
    before, _ = simulate(requests, gpus_per_zone=8)
    monkeypatch.setitem(POLICIES, "default", POLICIES["round_robin"])
    after, _ = simulate(requests, gpus_per_zone=8)

    def p99(kept: Recorder) -> float:
        ordered = sorted(s["e2e_s"] for s in kept.ok)
        return ordered[int(0.99 * len(ordered))]

    assert p99(after) > 1.1 * p99(before)


def test_a_lost_zone_and_then_region_lose_no_request() -> None:
    requests = arrivals(1500, rate=40.0)
    kept, _ = simulate(requests, events=((10.0, "east-0"), (20.0, "east")))
    fates = sorted([s["id"] for s in kept.ok] + [f["id"] for f in kept.lost])
    assert fates == [r.id for r in requests]  # each request ended exactly once
    assert len(kept.lost) <= 30  # only those on a GPU when it died may fail
    after = [s for s in kept.ok if s["at"] > 22.0]
    assert after and all(s["region"] == "west" for s in after)
    between = [s for s in kept.ok if 12.0 < s["at"] < 19.0 and s["region"] == "east"]
    assert between and all(s["zone"] == "east-1" for s in between)


def test_a_per_try_timeout_moves_a_request_off_a_gpu_slower_than_the_tier_thinks() -> None:
    """One GPU runs 50x slower than its hardware class (the local tier's rate seed says):
    the request sent there outlives the forwarder's per-try limit, is cancelled on that
    GPU (its slot and KV freed) and served by another, two attempts in all."""

    async def main() -> tuple[Recorder, SimDeployment, float]:
        loop = asyncio.get_running_loop()
        deployment, recorder, flow = started(loop)
        zone = deployment.zones["east-0"]
        gpus = list(zone.gpus.values())
        # The GPU the tier ranks first for an idle zone: the fastest hardware class.
        slow = max(gpus, key=lambda g: g.speed)
        slow.set_speed(slow.speed / 50)
        await asyncio.sleep(1.0)
        req = SimRequest(0, loop.time(), "washington", CITIES[0][1], "t", 64, 100, max_tokens=100)
        await flow.serve(req)
        deployment.stop()
        per_try = deployment.topology.liveness.per_try_timeout
        return recorder, deployment, per_try.floor_s

    kept, deployment, floor_s = run_simulated(main())
    assert not kept.lost and len(kept.ok) == 1
    served = kept.ok[0]
    assert served["attempts"] == 2 and served["zone"] == "east-0"
    slow = max(deployment.zones["east-0"].gpus.values(), key=lambda g: g.cfg.speed)
    assert served["gpu"] != slow.name
    assert slow.running == 0 and not slow.waiting and slow.kv_cache_usage == 0
    # It waited out the per-try limit (at least its floor) before the second attempt.
    assert served["e2e_s"] > floor_s


def test_a_request_that_fails_over_leaves_nothing_for_the_cyclic_gc() -> None:
    """A per-try expiry and a GPU dying under a request both fail over; neither leaves
    a cycle (an error's traceback and a frame that holds the error, or the job whose
    future holds it), so a long run's memory does not wait on the cyclic GC."""

    async def main() -> tuple[list[object], Recorder]:
        loop = asyncio.get_running_loop()
        deployment, recorder, flow = started(loop)
        slow = max(deployment.zones["east-0"].gpus.values(), key=lambda g: g.speed)
        slow.set_speed(slow.speed / 50)
        await asyncio.sleep(1.0)
        free_unreachable()  # what setting up left behind
        await flow.serve(
            SimRequest(0, loop.time(), "washington", CITIES[0][1], "t", 64, 100, max_tokens=100)
        )
        loop.call_later(0.5, _lose, deployment, "east")
        await flow.serve(
            SimRequest(1, loop.time(), "washington", CITIES[0][1], "t", 64, 400, max_tokens=400)
        )
        left = unreachable_now()
        deployment.stop()
        return left, recorder

    left, kept = run_simulated(main())
    assert len(kept.ok) == 2 and not kept.lost
    assert kept.ok[0]["attempts"] == 2 and kept.ok[0]["region"] == "east"  # the per-try expiry
    assert kept.ok[1]["attempts"] >= 2 and kept.ok[1]["region"] == "west"  # the GPU that died
    assert request_leftovers(left) == []


def test_a_retry_waits_for_the_tiers_retry_budget() -> None:
    """The per-try expiry above, with the zone tier's retry budget taken (its floor of 3
    retries in flight held by others): the zone does not retry and answers UNAVAILABLE
    (``Attempts.error``: its one failure was no load shedding), which the region fails
    over on, to the other zone, as the servers' forwarders do. Each budget is back to
    what others hold once the request is over."""

    async def main() -> tuple[Recorder, SimDeployment, list[object]]:
        loop = asyncio.get_running_loop()
        deployment, recorder, flow = started(loop)
        zone = deployment.zones["east-0"]
        slow = max(zone.gpus.values(), key=lambda g: g.speed)
        slow.set_speed(slow.speed / 50)
        while zone.forwarding.budget.try_start_retry():
            pass
        await asyncio.sleep(1.0)
        free_unreachable()  # what setting up left behind
        await flow.serve(
            SimRequest(0, loop.time(), "washington", CITIES[0][1], "t", 64, 100, max_tokens=100)
        )
        left = unreachable_now()
        deployment.stop()
        return recorder, deployment, left

    kept, deployment, left = run_simulated(main())
    assert not kept.lost and len(kept.ok) == 1
    served = kept.ok[0]
    assert served["attempts"] == 2 and served["region"] == "east"
    assert served["zone"] == "east-1"  # east-0 refused to retry: the region failed over
    zone_budget = deployment.zones["east-0"].forwarding.budget
    region_budget = deployment.by_region["east"].forwarding.budget
    assert zone_budget.active_retries == 3  # the three held before, none let go twice
    assert region_budget.active_retries == 0  # the region's retry was let go
    budgets = [deployment.global_forwarding.budget, region_budget, zone_budget]
    assert [b.active_requests for b in budgets] == [0, 0, 0]
    assert request_leftovers(left) == []  # the refusal's error made no cycle


def test_failing_over_from_a_zone_lost_under_a_request_needs_no_retry_budget() -> None:
    """A zone lost while a request runs on one of its GPUs answers nothing (no capacity
    hint), so its region marks it down at once and moves the request on without a retry
    (``Failover.child_down``): the region's budget, held in full by others, does not
    stop it, as a server's forwarder lets a failover from a dead child through."""

    async def main() -> tuple[Recorder, SimDeployment, str]:
        loop = asyncio.get_running_loop()
        deployment, recorder, flow = started(loop)
        region = deployment.by_region["east"]
        while region.forwarding.budget.try_start_retry():
            pass
        await asyncio.sleep(1.0)
        req = SimRequest(0, loop.time(), "washington", CITIES[0][1], "t", 64, 400, max_tokens=400)
        task = loop.create_task(flow.serve(req))
        await asyncio.sleep(0.2)
        (lost,) = [z for z in region.local.values() if any(g.running for g in z.gpus.values())]
        _lose(deployment, lost.cfg.name)
        await task
        deployment.stop()
        return recorder, deployment, lost.cfg.name

    kept, deployment, lost = run_simulated(main())
    assert not kept.lost and len(kept.ok) == 1
    assert kept.ok[0]["region"] == "east" and kept.ok[0]["zone"] != lost
    region_budget = deployment.by_region["east"].forwarding.budget
    assert region_budget.active_retries == 3  # only the three held before: none taken
    budgets = [deployment.global_forwarding.budget, region_budget]
    budgets += [z.forwarding.budget for z in deployment.zones.values()]
    assert [b.active_requests for b in budgets] == [0] * len(budgets)
    assert all(z.forwarding.budget.active_retries == 0 for z in deployment.zones.values())


def test_a_zone_out_of_attempts_answers_unavailable_and_its_region_fails_over() -> None:
    """Both GPUs of the zone the request goes to run 50x slower than the tier thinks:
    each attempt outlives its per-try limit, and once no GPU is left to try the zone
    answers what ``Attempts.error`` makes of the expiries, UNAVAILABLE (not the last
    expiry's DEADLINE_EXCEEDED, on which no tier fails over), so the region sends the
    request to its other zone, as the servers' forwarders do."""

    async def main() -> Recorder:
        loop = asyncio.get_running_loop()
        deployment, recorder, flow = started(loop)
        for gpu in deployment.zones["east-0"].gpus.values():
            gpu.set_speed(gpu.speed / 50)
        await asyncio.sleep(1.0)
        await flow.serve(
            SimRequest(0, loop.time(), "washington", CITIES[0][1], "t", 64, 100, max_tokens=100)
        )
        deployment.stop()
        return recorder

    kept = run_simulated(main())
    assert not kept.lost and len(kept.ok) == 1
    served = kept.ok[0]
    assert served["region"] == "east" and served["zone"] == "east-1"
    # Every attempt the zone's policy allows expired in east-0 (a GPU tried twice when
    # both were), then east-1 served it.
    assert served["attempts"] == local_policy(fleet(2), "east-0").max_attempts + 1
