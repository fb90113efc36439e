"""The validation bench's real side: emulated GPU workers behind a real local tier, on loopback.

``run_real`` starts a fresh zone for one load level — every GPU of the topology
as a ``sim.worker.GpuWorker`` (a real gRPC V2 server around ``sim.engine``) and
the zone's local tier from ``local_lb.server.build_local_tier`` (a real
``TierServer`` publishing its summaries to the given Redis) — and sends each
shot with ``grpc.aio`` ``ModelInfer`` straight to the local tier at its arrival
time (open loop: a late answer never delays the next send). The local tier
trusts its caller as it trusts its regional tier (plaintext, no auth), hashes
the prompt's blocks itself and counts its words as tokens, as the edge would.
A request's latency is client-side, from its *scheduled* send time to its
answer, so it includes the gRPC hops and the tier's own work.

Everything runs in this one asyncio process: the client, the tier and the GPU
engines share one core. ``idle_overhead`` measures what the router and the two
gRPC hops add to a request at idle (client latency minus the engine's modelled
time for a one-token request); the loop's lag and this process's CPU over the
run say how busy that core was; each GPU's running batch is sampled beside the
lag. Every server is stopped at the end, on error too.

``front`` puts something else in the local tier's place (``bench.zone_peers``: nginx
or HAProxy in front of the same GPUs, on the same shots); the route trailer then
names no GPU and the idle overhead is not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.report import pct
from bench.sim_validation_workload import REGION, ZONE, Shot
from common.config.topology import Topology
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE, SESSION, trailer
from common.request.v2 import generate_request
from common.tier.server import TierServer
from local_lb.server import build_local_tier
from sim.engine import step_cost_s
from sim.requests import SIM_MODEL
from sim.worker import ZoneWorkers

CHANNELS = 4  # separate HTTP/2 connections, far below each one's stream limit
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
READY_TIMEOUT_S = 10.0
LAG_SAMPLE_S = 0.02
IDLE_PROBES = 20
Generate = Callable[..., AsyncGenerator[str, None]]
# Starts what the client calls in front of the started GPUs (stopped by the stack) and
# returns its address once it forwards.
Front = Callable[[contextlib.AsyncExitStack, Topology], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Sample:
    id: int
    latency_s: float  # scheduled send -> answer
    code: str
    send_lag_s: float  # how late the call left
    gpu: str


@dataclass
class RealResult:
    samples: list[Sample]
    attempts_per_gpu: dict[str, int]  # requests the engines took (retries included)
    retried_ids: frozenset[int]  # requests that reached a GPU more than once
    mean_batch: dict[str, float]  # per GPU: running sequences, sampled over the run
    prefix_hit_share: float  # prompt tokens served from the engines' prefix caches
    idle_overhead_ms: float | None  # median, one-token requests at idle (local tier only)
    loop_lag_p99_ms: float
    process_cpu_cores: float  # this process (client + tier + GPUs) over the load
    seconds: float

    @property
    def ok_latencies(self) -> dict[int, float]:
        return {s.id: s.latency_s for s in self.samples if s.code == "OK"}

    @property
    def retried(self) -> int:
        """Requests a per-try timeout re-sent to another GPU."""
        return len(self.retried_ids)

    @property
    def gpu_of(self) -> dict[int, str]:
        """The GPU that served each request (OK only)."""
        return {s.id: s.gpu for s in self.samples if s.code == "OK"}

    @property
    def requests_per_gpu(self) -> dict[str, int]:
        """Where the served requests were served (the route trailer's GPU)."""
        return dict(Counter(s.gpu for s in self.samples if s.code == "OK"))

    @property
    def codes(self) -> dict[str, int]:
        return dict(Counter(s.code for s in self.samples))


@dataclass
class _Monitor:
    """Every ``LAG_SAMPLE_S``: how late the event loop ran the timer (a busy core), and
    each GPU's running batch."""

    workers: ZoneWorkers
    lags: list[float] = field(default_factory=list)
    batch_sum: Counter[str] = field(default_factory=Counter)
    samples: int = 0
    task: asyncio.Task[None] | None = None

    def mean_batch(self) -> dict[str, float]:
        return {w.gpu.name: self.batch_sum[w.gpu.name] / max(1, self.samples) for w in self.workers}

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="validation-lag")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_SAMPLE_S
            await asyncio.sleep(LAG_SAMPLE_S)
            self.lags.append(loop.time() - due)
            self.samples += 1
            for w in self.workers:
                self.batch_sum[w.gpu.name] += w.engine.running


class _PromptLog:
    """Counts the prompts every GPU engine is asked to generate for, by wrapping each
    engine's ``generate`` on its instance (records only): a request whose prompt (unique
    per request here) reached the engines twice was retried by a per-try timeout."""

    def __init__(self, workers: ZoneWorkers) -> None:
        self.seen: Counter[str] = Counter()
        for worker in workers:
            engine = worker.engine
            real = engine.generate

            def generate(
                prompt: str, max_tokens: int, *, real: Generate = real, **options: Any
            ) -> AsyncGenerator[str, None]:
                self.seen[prompt] += 1
                return real(prompt, max_tokens, **options)

            setattr(engine, "generate", generate)  # noqa: B010 (this instance only)


async def run_real(
    topology: Topology,
    shots: Sequence[Shot],
    *,
    timeout_s: float,
    budget_s: float,
    front: Front | None = None,
    policy: str = "default",
) -> RealResult:
    """Serve ``shots`` on a fresh real zone, through its local tier (with the local
    ``policy``) or ``front``; stop every server before returning."""
    async with contextlib.AsyncExitStack() as stack:
        workers = await _start_workers(stack, topology)
        prompts = _PromptLog(workers)
        if front is None:
            address = await _local_tier(stack, topology, policy)
        else:
            address = await front(stack, topology)
        stubs = []
        for _ in range(CHANNELS):
            channel = grpc.aio.insecure_channel(address, CHANNEL_OPTIONS)
            stack.push_async_callback(channel.close)
            stubs.append(pb_grpc.GRPCInferenceServiceStub(channel))
        monitor = _Monitor(workers)
        monitor.start()
        stack.push_async_callback(monitor.stop)
        cpu0, wall0 = time.process_time(), time.monotonic()
        async with asyncio.timeout(budget_s):
            samples = await _send_all(stubs, shots, timeout_s)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        await monitor.stop()
        engines = [w.engine for w in workers]
        prompt = sum(e.prompt_tokens_total for e in engines)
        hits = sum(e.prefix_cache_hit_tokens for e in engines)
        per_gpu = {w.gpu.name: w.engine.requests_total for w in workers}
        overhead = None if front else await _idle_overhead(stubs[0], topology, timeout_s)
        return RealResult(
            samples=samples,
            attempts_per_gpu=per_gpu,
            retried_ids=frozenset(s.id for s in shots if prompts.seen[s.prompt] > 1),
            mean_batch=monitor.mean_batch(),
            prefix_hit_share=hits / prompt if prompt else 0.0,
            idle_overhead_ms=overhead,
            loop_lag_p99_ms=1000 * (pct(monitor.lags, 0.99) or 0.0),
            process_cpu_cores=cpu / wall if wall > 0 else 0.0,
            seconds=wall,
        )


def tier_address(topology: Topology) -> str:
    return topology.zone(REGION, ZONE).endpoint.address


async def _start_workers(stack: contextlib.AsyncExitStack, topology: Topology) -> ZoneWorkers:
    """The zone's GPUs; ``stack`` stops them after what is started in front of them."""
    workers = ZoneWorkers(
        topology.zone(REGION, ZONE), region=REGION, time_scale=topology.time_scale
    )
    await workers.start()  # stops what it started if one fails
    stack.push_async_callback(workers.stop, 0)
    return workers


async def _local_tier(stack: contextlib.AsyncExitStack, topology: Topology, policy: str) -> str:
    """The zone's real local tier in front of its GPUs, once it holds every GPU healthy."""
    tier = build_local_tier(topology, REGION, ZONE, policy=policy)
    stack.push_async_callback(tier.stop, 0)
    await tier.start()
    await _ready(tier)
    return tier_address(topology)


async def _ready(tier: TierServer) -> None:
    """Every GPU healthy in the tier's eyes, and one health/metrics round behind us."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    while not all(c.healthy for c in tier.children):
        if loop.time() > deadline:
            down = [c.name for c in tier.children if not c.healthy]
            raise RuntimeError(f"the local tier still holds GPUs {down} down after start")
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # the monitor's first scrape of every GPU's metrics


async def _send_all(
    stubs: Sequence[pb_grpc.GRPCInferenceServiceStub], shots: Sequence[Shot], timeout_s: float
) -> list[Sample]:
    """Start each shot's call at its arrival time; return every sample once all ended."""
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.05
    tasks = []
    for shot in shots:
        delay = t0 + shot.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        stub = stubs[shot.id % len(stubs)]
        tasks.append(loop.create_task(send_shot(stub, shot, t0 + shot.at_s, timeout_s)))
    return list(await asyncio.gather(*tasks))


async def send_shot(
    stub: pb_grpc.GRPCInferenceServiceStub, shot: Shot, due: float, timeout_s: float
) -> Sample:
    """One call for ``shot`` (its session, if any, as ``x-meridian-session``), timed
    from ``due``."""
    loop = asyncio.get_running_loop()
    lag = loop.time() - due
    request = generate_request(SIM_MODEL, shot.prompt, shot.max_tokens)
    metadata = ((SESSION, shot.session),) if shot.session else None
    gpu = ""
    try:
        call = stub.ModelInfer(request, timeout=timeout_s, metadata=metadata)
        await call
        code = "OK"
        gpu = (trailer(await call.trailing_metadata(), ROUTE) or "").rpartition("/")[2]
    except grpc.aio.AioRpcError as err:
        code = err.code().name
    return Sample(shot.id, loop.time() - due, code, lag, gpu)


async def _idle_overhead(
    stub: pb_grpc.GRPCInferenceServiceStub, topology: Topology, timeout_s: float
) -> float:
    """Median ms a one-token, one-word request takes beyond its engine step, at idle."""
    loop = asyncio.get_running_loop()
    speeds = {g.name: g.speed for g in topology.zone(REGION, ZONE).gpus}
    extra = []
    for i in range(IDLE_PROBES):
        started = loop.time()
        call = stub.ModelInfer(generate_request(SIM_MODEL, f"idle{i}", 1), timeout=timeout_s)
        await call
        took = loop.time() - started
        gpu = (trailer(await call.trailing_metadata(), ROUTE) or "").rpartition("/")[2]
        engine_s = step_cost_s(1, 1) * topology.time_scale / speeds[gpu]
        extra.append(took - engine_s)
    return 1000 * statistics.median(extra)
