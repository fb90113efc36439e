"""SimGpu, the engine's cost model jumping from event to event, against the engine itself.

Both run in simulated time on the same arrivals: the real ``GpuEngine`` steps
token by token on a ``SimulatedLoop``; ``SimGpu`` computes when things change.
Every request's first-token and last-token times must agree.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from common.request.prefix import prompt_block_hashes
from sim.clock import run_simulated
from sim.engine import GpuEngine
from sim.gpu_model import GpuFailed, GpuRefused, SimGpu

Arrival = tuple[float, str, int]


def _config(max_concurrency: int = 8, kv: int = 8000, hardware: str = "A100") -> GpuConfig:
    return GpuConfig(
        "g", Endpoint("127.0.0.1", 1), Endpoint("127.0.0.1", 2), hardware, ("m",),
        max_concurrency=max_concurrency, kv_cache_tokens=kv,
    )


def _arrivals(seed: int, n: int, rate: float) -> list[Arrival]:
    """Poisson arrivals; a third of the prompts start with one of three shared prefixes."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        shared = rng.randrange(6)
        head = [f"sys{shared}-{k}" for k in range(64)] if shared < 3 else []
        body = [f"r{i}-{k}" for k in range(rng.randint(5, 500))]
        out.append((t, " ".join(head + body), rng.randint(1, 120)))
    return out


async def _on_engine(cfg: GpuConfig, arrivals: list[Arrival]) -> list[tuple[float, float]]:
    engine = GpuEngine(cfg)
    await engine.start()
    loop = asyncio.get_running_loop()
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(arrivals)

    async def one(i: int, at: float, prompt: str, max_tokens: int) -> None:
        await asyncio.sleep(at - loop.time())
        first = None
        async for _ in engine.generate(prompt, max_tokens):
            first = first if first is not None else loop.time()
        assert first is not None
        times[i] = (first - at, loop.time() - at)

    await asyncio.gather(*(one(i, *a) for i, a in enumerate(arrivals)))
    await engine.stop()
    return times


async def _on_model(
    cfg: GpuConfig, arrivals: list[Arrival]
) -> tuple[list[tuple[float, float]], int]:
    loop = asyncio.get_running_loop()
    gpu = SimGpu(cfg, loop)
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(arrivals)
    peak = 0

    async def one(i: int, at: float, prompt: str, max_tokens: int) -> None:
        await asyncio.sleep(at - loop.time())
        nonlocal peak
        job = gpu.submit(len(prompt.split()), max_tokens, prompt_block_hashes(prompt))
        peak = max(peak, len(gpu.waiting))
        await job.done
        times[i] = (job.first_token_at - at, job.finished_at - at)

    await asyncio.gather(*(one(i, *a) for i, a in enumerate(arrivals)))
    return times, peak


@pytest.mark.parametrize(("rate", "hardware"), [(2.0, "A100"), (6.0, "A100"), (9.0, "H100")])
def test_every_request_matches_the_engine(rate: float, hardware: str) -> None:
    cfg = _config(hardware=hardware)
    arrivals = _arrivals(seed=int(rate), n=300, rate=rate)
    engine = run_simulated(_on_engine(cfg, arrivals))
    model, peak_waiting = run_simulated(_on_model(cfg, arrivals))
    worst = max(
        max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(engine, model, strict=True)
    )
    assert worst < 1e-6
    # The load really queued: requests waited in the GPU's own queue for a slot or KV.
    assert peak_waiting >= 2


def test_utilisation_integrals_and_prefix_hits() -> None:
    async def main() -> SimGpu:
        loop = asyncio.get_running_loop()
        gpu = SimGpu(_config(), loop)
        first = gpu.submit(32, 10, [1, 2])
        await first.done
        # Alone: one prefill step then nine decode steps at batch 1.
        assert gpu.busy_s == pytest.approx(first.finished_at - first.submitted_at)
        assert gpu.slot_s == pytest.approx(gpu.busy_s)
        await asyncio.sleep(1.0)  # idle time is not busy
        second = gpu.submit(32, 10, [1, 2])
        await second.done
        assert second.cached_tokens == 32
        assert second.finished_at - second.submitted_at < first.finished_at - first.submitted_at
        return gpu

    gpu = run_simulated(main())
    assert gpu.prompt_tokens_total == 64 and gpu.cached_tokens_total == 32


def test_failure_fails_every_job_and_refuses_until_recovered() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gpu = SimGpu(_config(max_concurrency=1), loop)
        running, waiting = gpu.submit(10, 50, []), gpu.submit(10, 50, [])
        await asyncio.sleep(0.05)
        assert len(gpu.fail("power loss")) == 2
        for job in (running, waiting):
            with pytest.raises(GpuFailed, match="power loss"):
                await job.done
        with pytest.raises(GpuFailed, match="down"):
            gpu.submit(10, 5, [])
        gpu.recover()
        await gpu.submit(10, 5, []).done
        with pytest.raises(GpuRefused, match="8000"):
            gpu.submit(7990, 20, [])

    run_simulated(main())
