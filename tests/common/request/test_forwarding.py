"""The status a request ends with once every attempt failed; the loop's contract with
its caller (the deadline it is given, the trailers it hands back), without gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from common.basics.errors import RETRY_AFTER_MS, RouteError
from common.basics.vocabulary import Priority
from common.capacity.summary import CAPACITY_HINT
from common.config.node import Endpoint
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import Attempts, Failover, Forwarder, ForwardingPolicy
from common.request.pick import PickRequest
from common.request.routing import ROUTE, RouteHints
from tests.common.request.front import InOrder

MODEL = "demo-llm"


def failover(child: str, code: grpc.StatusCode, retry_ms: str | None = None) -> Failover:
    trailers = ((RETRY_AFTER_MS, retry_ms),) if retry_ms else ()
    return Failover(child, code, "busy", trailers)


def test_every_child_shedding_is_resource_exhausted_with_the_soonest_retry() -> None:
    attempts = Attempts(
        failures=[
            failover("eu-west", grpc.StatusCode.RESOURCE_EXHAUSTED, "800"),
            failover("us-east", grpc.StatusCode.RESOURCE_EXHAUSTED, "300"),
        ]
    )
    err = attempts.error("region", "demo-llm")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.trailers)[RETRY_AFTER_MS] == "300"
    assert "eu-west" in err.message and "us-east" in err.message


def test_any_unreachable_child_makes_it_unavailable() -> None:
    attempts = Attempts(
        failures=[
            failover("eu-west", grpc.StatusCode.RESOURCE_EXHAUSTED, "800"),
            failover("us-east", grpc.StatusCode.UNAVAILABLE),
        ]
    )
    err = attempts.error("region", "demo-llm")
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "demo-llm" in err.message


# ---------------------------------------------------------------- the loop without gRPC


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Answering:
    """An attempt every child answers with ``trailers``; records each timeout it got."""

    trailers: tuple[tuple[str, str], ...]
    method: str = "ModelInfer"
    committed: bool = False
    reported_completion: int | None = None
    timeouts: list[float | None] = field(default_factory=list)

    async def send(self, child: Child, metadata: Any, timeout: float | None) -> tuple[str, Any]:
        self.timeouts.append(timeout)
        return child.name, self.trailers


def forwarder(clock: Clock) -> Forwarder:
    children = ChildSet(
        [Child("a", Endpoint("127.0.0.1", 1), frozenset({MODEL}))],
        probe_interval_s=1,
        summary_ttl_s=1,
        probe=False,
        clock=clock,
    )
    policy = ForwardingPolicy(kind="zone", route_prefix="r")
    balancer = RankingBalancer(InOrder(), children)
    return Forwarder(policy, balancer, hint_source=lambda model: "own", clock=clock)


HINTS = RouteHints(None, None, None, Priority.STANDARD, 0, ())
PICK = PickRequest(MODEL, "", None, None, Priority.STANDARD)


async def test_forward_hands_back_the_trailers_for_the_caller_to_set() -> None:
    attempt = Answering(((CAPACITY_HINT, "child's"), (ROUTE, "gpu-1"), ("x-load", "3")))
    result, route, trailers = await forwarder(Clock()).forward(attempt, PICK, HINTS, None)
    assert (result, route) == ("a", "r/gpu-1")
    assert trailers == (("x-load", "3"), (ROUTE, "r/gpu-1"), (CAPACITY_HINT, "own"))
    assert attempt.timeouts == [None]  # no deadline: none below either


async def test_the_attempt_gets_the_time_left_before_the_callers_deadline() -> None:
    clock = Clock()
    fwd = forwarder(clock)
    deadline = fwd.deadline_in(5.0)
    clock.now += 2.0
    attempt = Answering(())
    await fwd.forward(attempt, PICK, HINTS, deadline)
    assert attempt.timeouts == [3.0]


async def test_a_deadline_already_spent_is_deadline_exceeded_without_an_attempt() -> None:
    clock = Clock()
    fwd = forwarder(clock)
    attempt = Answering(())
    with pytest.raises(RouteError) as caught:
        await fwd.forward(attempt, PICK, HINTS, fwd.deadline_in(0.0))
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert attempt.timeouts == []
    assert fwd.budget.active_requests == 0
    assert [c.outstanding_requests for c in fwd.balancer.ranked(PICK)] == [0]


async def test_an_answer_reported_length_teaches_the_tier_what_to_plan_for() -> None:
    fwd = forwarder(Clock())
    assert fwd.outputs.planned(MODEL, 4096) == 4096
    await fwd.forward(Answering((), reported_completion=120), PICK, HINTS, None)
    assert fwd.outputs.planned(MODEL, 4096) == 120
    # An answer whose length was not reported teaches nothing.
    await fwd.forward(Answering((), reported_completion=None), PICK, HINTS, None)
    assert fwd.outputs.typical[MODEL] == 120
