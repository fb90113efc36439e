"""SimulatedLoop and run_simulated: simulated time, and the GC settings of a run."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest

from sim.clock import RUN_GC_THRESHOLD, SimulatedLoop, run_simulated


def test_sleeping_moves_simulated_time_not_wall_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600.0)
        return loop.time()

    assert run_simulated(main(), start=5.0) == 3605.0


def test_a_run_does_not_collect_and_restores_the_collector_after() -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    seen: list[tuple[tuple[int, int, int], int]] = []

    async def main() -> None:
        seen.append((gc.get_threshold(), gc.get_freeze_count()))

    run_simulated(main())
    ((during, frozen),) = seen
    assert during == (RUN_GC_THRESHOLD, before[1], before[2])
    assert frozen > frozen_before  # what existed before the run is left out of collections
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen_before


def test_the_collector_is_restored_when_the_run_raises() -> None:
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()

    async def main() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_simulated(main())
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen_before


def test_waiting_for_what_can_never_happen_is_an_error_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(RuntimeError, match="nothing scheduled and nothing ready"):
        run_simulated(main())


class _AsyncioIteration(SimulatedLoop):
    """The simulated clock with asyncio's own timer heap and loop iteration."""

    call_at = asyncio.BaseEventLoop.call_at  # type: ignore[assignment]
    call_soon = asyncio.BaseEventLoop.call_soon  # type: ignore[assignment]
    _run_once = asyncio.BaseEventLoop._run_once  # type: ignore[attr-defined]


def _schedule(loop: SimulatedLoop) -> list[tuple[float, int]]:
    """Random timers (many at the same instants, most cancelled, some set from
    callbacks) and sleeping tasks; what ran when."""
    rng = random.Random(5)
    seen: list[tuple[float, int]] = []

    async def sleeper(i: int) -> None:
        for _ in range(3):
            await asyncio.sleep(rng.choice([0.0, 0.25, 0.5]))
            seen.append((asyncio.get_running_loop().time(), 1000 + i))

    async def main() -> None:
        def fire(i: int) -> None:
            seen.append((loop.time(), i))
            if i % 7 == 0:
                loop.call_later(rng.choice([0.25, 1.0]), fire, i + 10_000)

        handles = [loop.call_at(rng.choice([0.5, 1.0, 1.5, 2.0]), fire, i) for i in range(400)]
        for h in rng.sample(handles, 260):  # past half: the heap is rebuilt
            h.cancel()
        await asyncio.gather(*(sleeper(i) for i in range(50)))
        await asyncio.sleep(5.0)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return seen


def test_the_loop_runs_timers_and_tasks_in_exactly_the_order_asyncio_s_own_loop_does() -> None:
    # Event for event, ties at one instant included (their order is the timer heap's).
    ours, theirs = _schedule(SimulatedLoop()), _schedule(_AsyncioIteration())
    assert len(ours) > 250
    assert ours == theirs
    assert [t for t, _ in ours] == sorted(t for t, _ in ours)


def _failures(loop: SimulatedLoop) -> list[tuple[float, str, str]]:
    seen: list[tuple[float, str, str]] = []

    def boom(n: int) -> None:
        raise ValueError(f"boom {n}")

    async def main() -> None:
        loop.call_soon(boom, 1)
        loop.call_later(0.5, boom, 2)
        await asyncio.sleep(1.0)

    def handler(_: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        seen.append(
            (loop.time(), str(context["message"]).split(" at ")[0], repr(context["exception"]))
        )

    loop.set_exception_handler(handler)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return seen


def test_a_callback_that_raises_reaches_the_exception_handler_as_in_asyncio() -> None:
    ours, theirs = _failures(SimulatedLoop()), _failures(_AsyncioIteration())
    assert ours == theirs
    assert [(t, e) for t, _, e in ours] == [
        (0.0, "ValueError('boom 1')"),
        (0.5, "ValueError('boom 2')"),
    ]
    assert ours[0][1].startswith("Exception in callback")
