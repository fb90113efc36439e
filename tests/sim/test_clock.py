"""SimulatedLoop and run_simulated: simulated time, and the GC settings of a run."""

from __future__ import annotations

import asyncio
import gc

import pytest

from sim.clock import RUN_GC_THRESHOLD, run_simulated


def test_sleeping_moves_simulated_time_not_wall_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600.0)
        return loop.time()

    assert run_simulated(main(), start=5.0) == 3605.0


def test_a_run_collects_in_large_batches_and_restores_the_collector_after() -> None:
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
