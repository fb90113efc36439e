"""Utilisation while the load lasts: a GPU's busy share between two instants, a step
under way counted up to the instant, idle time not at all."""

from __future__ import annotations

import asyncio

import pytest

from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from sim.busy_window import BusyWindow
from sim.clock import run_simulated
from sim.gpu_model import SimGpu


def _gpu(loop: asyncio.AbstractEventLoop, name: str) -> SimGpu:
    cfg = GpuConfig(
        name,
        Endpoint("127.0.0.1", 1),
        Endpoint("127.0.0.1", 2),
        "A100",
        ("m",),
        max_concurrency=8,
        kv_cache_tokens=8000,
    )
    return SimGpu(cfg, loop)


def test_the_window_counts_busy_time_inside_it_mid_step_included() -> None:
    async def job_seconds() -> float:
        job = _gpu(asyncio.get_running_loop(), "probe").submit(512, 40, [1])
        await job.done
        return job.finished_at - job.submitted_at

    length = run_simulated(job_seconds())
    start_at = 0.5

    async def main() -> list[float] | None:
        loop = asyncio.get_running_loop()
        busy, idle = _gpu(loop, "busy"), _gpu(loop, "idle")
        # From the job's middle (mid-step: 40 steps, the window opens between two)
        # to a second after it ended.
        window = BusyWindow([busy, idle], start_at + length * 0.4999, start_at + length + 1.0)
        loop.call_at(window.start_s, window.begin)
        loop.call_at(window.end_s, window.end)
        await asyncio.sleep(start_at)
        await busy.submit(512, 40, [1]).done
        await asyncio.sleep(window.end_s - loop.time() + 0.1)
        return window.shares

    shares = run_simulated(main())
    assert shares is not None
    span = length * 0.5001 + 1.0
    assert shares[0] == pytest.approx(length * 0.5001 / span, rel=1e-6)
    assert shares[1] == 0.0


def test_a_window_read_before_it_ends_has_no_shares_and_a_bad_one_is_refused() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        window = BusyWindow([_gpu(loop, "a")], 0.0, 1.0)
        window.begin()
        assert window.shares is None
        with pytest.raises(ValueError, match="start_s < end_s"):
            BusyWindow([], 2.0, 1.0)

    run_simulated(main())
