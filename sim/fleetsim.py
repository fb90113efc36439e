"""A fast, deterministic simulation of one local tier in front of its GPUs.

It reuses the real pickers and the real cost and learning formulas, but
replaces gRPC and the emulated GPU with processor sharing in simulated time:
each GPU runs up to ``slots`` requests at once and splits its true rate
(hardware speed × throttle × ``A100_WORK_PER_S``) among them; requests that
find no free slot wait in a FIFO (the real tier's central queue). Tests and
benchmarks use it to measure shares and latency over thousands of requests
in a fraction of a second.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from common.basics.vocabulary import Priority
from common.config.node import Endpoint
from common.request.pick import PickRequest
from local_lb.cost import ewma, rate_sample, request_work
from local_lb.policies import make_picker
from local_lb.state import GpuChild, LocalView

A100_WORK_PER_S = 2000.0
MODEL = "sim-model"


@dataclass
class SimGpu:
    """The simulated hardware behind one GpuChild."""

    child: GpuChild
    true_rate: float
    # Each job: [remaining work, arrived, started, work, concurrent at start].
    running: list[list[float]] = field(default_factory=list)
    work_done: float = 0.0


@dataclass
class SimResult:
    """What a run measured."""

    work_by_gpu: dict[str, float]
    latencies_s: list[float]

    def share(self, name: str) -> float:
        return self.work_by_gpu[name] / max(sum(self.work_by_gpu.values()), 1e-9)

    def p(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_gpus(speeds: list[float], slots: int = 8, *, learned: bool = False) -> list[GpuChild]:
    """GPUs with the given true speeds; ``learned=False`` seeds every rate as an A100's,
    so the picker must learn the differences itself."""
    return [
        GpuChild(
            name=f"gpu{i}",
            endpoint=Endpoint("127.0.0.1", 1),
            models=frozenset({MODEL}),
            speed=s,
            slots=slots,
            rate=(s if learned else 1.0) * A100_WORK_PER_S,
        )
        for i, s in enumerate(speeds)
    ]


def simulate(
    speeds: list[float],
    *,
    policy: str = "default",
    load: float = 0.7,
    requests: int = 3000,
    slots: int = 8,
    seed: int = 1,
    dt: float = 0.002,
    max_tokens: tuple[int, int] = (16, 256),
) -> SimResult:
    """Offer ``requests`` Poisson arrivals at ``load`` × total capacity; return shares."""
    rng = random.Random(seed)
    gpus = make_gpus(speeds, slots)
    view = LocalView(tuple(gpus))
    picker = make_picker(policy, view, random.Random(seed + 1))
    sims = {g.name: SimGpu(g, g.speed * A100_WORK_PER_S) for g in gpus}
    mean_work = (max_tokens[0] + max_tokens[1]) / 2
    arrival_rate = load * sum(s.true_rate for s in sims.values()) / mean_work
    waiting: list[tuple[float, PickRequest]] = []
    latencies: list[float] = []
    now, sent, next_arrival = 0.0, 0, rng.expovariate(arrival_rate)
    for _ in range(2_000_000):  # bounded: stops long before in any sane setting
        while sent < requests and next_arrival <= now:
            pick = PickRequest(
                MODEL, "", None, None, Priority.STANDARD, 0, rng.randint(*max_tokens)
            )
            waiting.append((now, pick))
            sent += 1
            next_arrival += rng.expovariate(arrival_rate)
        while waiting:
            ranked = picker.rank(waiting[0][1], view.free[MODEL], now)
            if not ranked:
                break
            arrived, pick = waiting.pop(0)
            gpu = ranked[0]
            assert isinstance(gpu, GpuChild)
            work = request_work(pick.prompt_tokens, pick.max_tokens)
            gpu.outstanding_requests += 1
            gpu.outstanding_work += work
            view.took(work)
            view.inflight_total += 1
            view.refresh(gpu)
            job = [work, arrived, now, work, float(gpu.outstanding_requests)]
            sims[gpu.name].running.append(job)
        for sim in sims.values():
            if not sim.running:
                continue
            step = sim.true_rate * dt / len(sim.running)
            for job in list(sim.running):
                job[0] -= step
                sim.work_done += step
                if job[0] <= 0:
                    sim.running.remove(job)
                    _finish(view, sim.child, job, now + dt, latencies)
        now += dt
        if sent >= requests and not waiting and not any(s.running for s in sims.values()):
            break
    return SimResult({n: s.work_done for n, s in sims.items()}, latencies)


def _finish(
    view: LocalView, gpu: GpuChild, job: list[float], now: float, latencies: list[float]
) -> None:
    _, arrived, started, work, concurrent = job
    elapsed = now - arrived
    sample = rate_sample(work, now - started, int(concurrent))
    if sample is not None:
        gpu.rate = ewma(gpu.rate, sample)
    gpu.latency_ewma_s = ewma(gpu.latency_ewma_s, elapsed) if gpu.latency_ewma_s else elapsed
    gpu.outstanding_requests -= 1
    gpu.outstanding_work -= work
    view.inflight_total -= 1
    view.refresh(gpu)
    latencies.append(elapsed)
