"""Each simulated tier forwards with the servers' own ``Forwarder``.

The tiers of ``tests.sim.test_deployment``'s small fleet hold a real forwarder
each; a setting of that forwarder (its policy's attempts, its back-off) changed in
the simulated deployment changes how a request fares, and a tier's answer up is
what its server's would be.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from common.basics.errors import RETRY_AFTER_MS, RouteError
from common.capacity.summary import CAPACITY_HINT
from common.request.forwarding import Forwarder
from common.request.routing import ROUTE
from sim.clock import run_simulated
from sim.deployment import SimDeployment
from sim.flow import RequestFlow, _answer_up
from sim.requests import SimRequest
from tests.sim.test_deployment import CITIES, Recorder, started


def one_attempt(forwarder: Forwarder) -> None:
    forwarder.policy = dataclasses.replace(forwarder.policy, max_attempts=1)


def serve_off_a_slow_gpu(change: str = "") -> Recorder:
    """One request to an idle fleet whose fastest GPU in east-0 (the one the zone ranks
    first) runs 50x slower than the tier thinks: the zone's per-try timeout cancels it
    there. ``change``: "zone" gives east-0's forwarder one attempt, "every" every tier's."""

    async def main() -> Recorder:
        loop = asyncio.get_running_loop()
        deployment, recorder, flow = started(loop)
        zone = deployment.zones["east-0"]
        slow = max(zone.gpus.values(), key=lambda g: g.speed)
        slow.set_speed(slow.speed / 50)
        if change == "zone":
            one_attempt(zone.forwarding)
        elif change == "every":
            forwarders = [deployment.global_forwarding, *tiers(deployment)]
            for forwarder in forwarders:
                one_attempt(forwarder)
        await asyncio.sleep(1.0)
        await serve(flow, loop)
        deployment.stop()
        return recorder

    return run_simulated(main())


def tiers(deployment: SimDeployment) -> list[Forwarder]:
    regions = [r.forwarding for r in deployment.by_region.values()]
    return regions + [z.forwarding for z in deployment.zones.values()]


async def serve(flow: RequestFlow, loop: asyncio.AbstractEventLoop) -> None:
    origin = CITIES[0][1]
    await flow.serve(SimRequest(0, loop.time(), "washington", origin, "t", 64, 100, max_tokens=100))


def test_every_tier_process_holds_a_real_forwarder_on_the_simulated_clock() -> None:
    async def main() -> tuple[list[Forwarder], float]:
        loop = asyncio.get_running_loop()
        deployment, _, _ = started(loop)
        deployment.stop()
        return [deployment.global_forwarding, *tiers(deployment)], loop.time()

    forwarders, now = run_simulated(main())
    assert all(isinstance(f, Forwarder) and f.clock() == now for f in forwarders)
    # One budget per tier process, none shared.
    assert len({id(f.budget) for f in forwarders}) == len(forwarders)


def test_by_default_the_zone_serves_the_request_on_its_next_gpu() -> None:
    kept = serve_off_a_slow_gpu()
    assert not kept.lost
    assert kept.ok[0]["zone"] == "east-0" and kept.ok[0]["attempts"] == 2


def test_a_zone_forwarder_allowed_one_attempt_hands_the_request_to_its_region() -> None:
    """east-0 out of attempts after the expiry answers UNAVAILABLE (``Attempts.error``)
    and the region fails the request over to east-1."""
    kept = serve_off_a_slow_gpu("zone")
    assert not kept.lost
    assert kept.ok[0]["zone"] == "east-1" and kept.ok[0]["attempts"] == 2


def test_forwarders_allowed_one_attempt_each_fail_the_request_a_failover_would_serve() -> None:
    kept = serve_off_a_slow_gpu("every")
    assert not kept.ok
    assert kept.lost[0]["code"] == "UNAVAILABLE" and kept.lost[0]["attempts"] == 1


def test_the_forwarders_back_off_before_a_retry_is_in_the_simulated_latency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = serve_off_a_slow_gpu().ok[0]["e2e_s"]
    monkeypatch.setattr("common.request.forwarding.backoff_delay_s", lambda n, rng: 3.0)
    after = serve_off_a_slow_gpu().ok[0]["e2e_s"]
    assert after > before + 2.5


HINT = ((CAPACITY_HINT, "own"),)


def test_a_live_tiers_error_keeps_the_loops_trailers_and_adds_its_own_hint() -> None:
    err = RouteError.exhausted("every GPU is at capacity", 250)
    answer = _answer_up(err, True, "zone z", HINT)
    assert answer.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = tuple(answer.trailing_metadata())
    assert trailers == ((RETRY_AFTER_MS, "250"), (CAPACITY_HINT, "own"))
    assert ROUTE not in dict(trailers)


def test_a_tier_lost_under_a_request_answers_unavailable_with_no_trailers() -> None:
    err = RouteError.exhausted("every GPU is at capacity", 250)
    answer = _answer_up(err, False, "zone z", HINT)
    assert answer.code() == grpc.StatusCode.UNAVAILABLE
    assert tuple(answer.trailing_metadata()) == ()
