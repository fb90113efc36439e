"""SimGpu, the engine's cost model jumping from event to event, against the engine itself.

Both run in simulated time on the same arrivals: the real ``GpuEngine`` steps
token by token on a ``SimulatedLoop``; ``SimGpu`` computes when things change.
Every request's first-token and last-token times must agree.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

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


Cancels = dict[int, float]


async def _cancelling(
    cfg: GpuConfig, arrivals: list[Arrival], cancels: Cancels, *, model: bool
) -> tuple[dict[int, tuple[float, float]], Counter[str]]:
    """Each request's (first, last) token times on the engine or on SimGpu, when
    request i's caller gives up at ``cancels[i]`` (as a per-try timeout cancels it);
    on SimGpu also where the cancelled requests were."""
    loop = asyncio.get_running_loop()
    engine = GpuEngine(cfg)
    gpu = SimGpu(cfg, loop)
    await engine.start()
    times: dict[int, tuple[float, float]] = {}
    where: Counter[str] = Counter()

    async def on_engine(i: int, at: float, prompt: str, max_tokens: int) -> None:
        await asyncio.sleep(at - loop.time())
        first = None
        async for _ in engine.generate(prompt, max_tokens):
            first = first if first is not None else loop.time()
        assert first is not None
        times[i] = (first - at, loop.time() - at)

    async def on_model(i: int, at: float, prompt: str, max_tokens: int) -> None:
        await asyncio.sleep(at - loop.time())
        job = gpu.submit(len(prompt.split()), max_tokens, prompt_block_hashes(prompt))
        try:
            await job.done
        except asyncio.CancelledError:
            where["waiting" if job in gpu.waiting else "running"] += 1
            gpu.cancel(job)  # what sim.flow does when a per-try timeout cancels the attempt
            raise
        times[i] = (job.first_token_at - at, job.finished_at - at)

    one = on_model if model else on_engine
    tasks = [asyncio.create_task(one(i, *a)) for i, a in enumerate(arrivals)]
    for i, when in cancels.items():
        loop.call_at(when, tasks[i].cancel)
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.stop()
    if model:
        assert gpu.running == 0 and not gpu.waiting and gpu.kv_cache_usage == 0
    return times, where


@pytest.mark.parametrize("seed", [1, 2])
def test_cancelled_requests_free_their_slot_as_on_the_engine(seed: int) -> None:
    """A fifth of the callers give up at random moments (waiting, running, or after the
    end): every other request's times still match the engine's."""
    cfg = _config(max_concurrency=4)
    arrivals = _arrivals(seed=seed, n=200, rate=8.0)
    rng = random.Random(seed)
    cancels = {i: at + rng.uniform(0.0, 2.0) for i, (at, _, _) in enumerate(arrivals) if i % 5 == 0}
    engine, _ = run_simulated(_cancelling(cfg, arrivals, cancels, model=False))
    model, where = run_simulated(_cancelling(cfg, arrivals, cancels, model=True))
    assert engine.keys() == model.keys()
    assert where["waiting"] >= 3 and where["running"] >= 3  # the rest had finished
    assert len(arrivals) - len(model) == where.total()
    worst = max(max(abs(a - b) for a, b in zip(engine[i], model[i], strict=True)) for i in model)
    assert worst < 1e-6


def test_a_step_whose_only_sequence_was_cancelled_runs_to_its_end() -> None:
    """Batch of one, cancelled mid-step; a request arriving before that step ends
    starts at its end, not at once (the engine is still stepping)."""
    cfg = _config(max_concurrency=1)
    arrivals = [(0.0, " ".join(f"w{k}" for k in range(400)), 50), (0.03, "short prompt", 5)]
    cancels = {0: 0.02}  # inside the first step: 400 prompt tokens take 80 ms to prefill
    engine, _ = run_simulated(_cancelling(cfg, arrivals, cancels, model=False))
    model, where = run_simulated(_cancelling(cfg, arrivals, cancels, model=True))
    assert list(model) == [1] and where == {"running": 1}
    first_step_s = 0.004 + 0.0002 + 0.0002 * 400
    assert model[1][0] == pytest.approx(first_step_s - 0.03 + 0.004 + 0.0002 + 0.0002 * 2)
    assert model[1] == pytest.approx(engine[1], abs=1e-9)
