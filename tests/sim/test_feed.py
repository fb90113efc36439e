"""sim.run's feed: every request starts when it falls due, and the feed ends with the last."""

from __future__ import annotations

import asyncio

from common.basics.geo import GeoPoint
from sim.clock import run_simulated
from sim.requests import SimRequest
from sim.run import _feed

ARRIVALS = [0.5, 0.5, 1.25, 3.0, 3.0, 3.0, 7.5]


def _requests(times: list[float]) -> list[SimRequest]:
    return [
        SimRequest(i, t, "c", GeoPoint(0, 0), "t", 10, 5, max_tokens=5) for i, t in enumerate(times)
    ]


def test_each_request_starts_at_its_arrival_and_the_feed_waits_for_the_last_to_end() -> None:
    started: list[tuple[int, float]] = []
    ended: list[tuple[int, float]] = []
    progress: list[int] = []

    async def serve(req: SimRequest) -> None:
        loop = asyncio.get_running_loop()
        started.append((req.id, loop.time()))
        await asyncio.sleep(10.0 - req.id)  # the first ones end last
        ended.append((req.id, loop.time()))

    async def main() -> float:
        loop = asyncio.get_running_loop()
        await _feed(iter(_requests(ARRIVALS)), serve, loop, progress.append)
        return loop.time()

    finished_at = run_simulated(main())
    assert [i for i, _ in started] == list(range(len(ARRIVALS)))
    for (_, at), expected in zip(started, ARRIVALS, strict=True):
        assert abs(at - expected) < 1e-12
    assert len(ended) == len(ARRIVALS)
    assert abs(finished_at - max(t + 10.0 - i for i, t in enumerate(ARRIVALS))) < 1e-12
    assert progress == [len(ARRIVALS)]  # every 1000th request, and the last


def test_an_empty_feed_returns_at_once_and_progress_counts_thousands() -> None:
    async def serve(req: SimRequest) -> None:
        return None

    async def main(times: list[float], progress: list[int]) -> float:
        loop = asyncio.get_running_loop()
        await _feed(iter(_requests(times)), serve, loop, progress.append)
        return loop.time()

    assert run_simulated(main([], [])) == 0.0
    seen: list[int] = []
    run_simulated(main([0.001 * i for i in range(2500)], seen))
    assert seen == [1000, 2000, 2500]  # and the last, which is no 1000th
