"""The run's feed: a request whose routing raised ends the run with that error."""

from __future__ import annotations

import asyncio

import pytest

from common.basics.geo import GeoPoint
from sim.clock import run_simulated
from sim.requests import SimRequest
from sim.run import _feed


def requests(n: int) -> list[SimRequest]:
    return [SimRequest(i, 0.1 * i, "c", GeoPoint(0, 0), "t", 16, 4, max_tokens=4) for i in range(n)]


def test_a_routing_bug_is_raised_not_left_as_a_hole_in_the_figures() -> None:
    served: list[int] = []

    async def serve(req: SimRequest) -> None:
        await asyncio.sleep(0.05)
        if req.id == 3:
            raise RuntimeError("picker bug on request 3")
        served.append(req.id)

    async def main() -> None:
        await _feed(iter(requests(10)), serve, asyncio.get_running_loop(), None)

    with pytest.raises(RuntimeError, match="request 3"):
        run_simulated(main())
    assert served == [0, 1, 2]  # none started after the failure


def test_every_request_is_served_when_none_raises() -> None:
    served: list[int] = []

    async def serve(req: SimRequest) -> None:
        await asyncio.sleep(1.0)
        served.append(req.id)

    async def main() -> None:
        await _feed(iter(requests(10)), serve, asyncio.get_running_loop(), None)

    run_simulated(main())
    assert sorted(served) == list(range(10))
