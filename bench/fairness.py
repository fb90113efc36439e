"""Tenant fairness in the local tier's central queue, in-process (a benchmark, not a test).

One local tier over ``--gpus`` emulated A100s (``ZoneWorkers``, real gRPC on loopback, a
real embedded Redis for the capacity publisher), two tenants of equal weight in the
topology's ``auth`` section. Requests go straight to the local tier's V2 endpoint with the
internal metadata ``x-meridian-tenant`` (which the local tier trusts from the tier above).

1. **calibrate**: closed loop with more clients than slots; C = requests/s the zone
   finishes at the chosen request size, at full batch.
2. **alone**: tenant ``steady`` sends Poisson at ``--steady-share`` × C.
3. **contended**: the same steady stream (same seed: same arrivals, same prompts) while
   tenant ``flood`` sends Poisson at ``--flood-x`` × its fair share (C / 2), each flood
   request with a ``--flood-deadline-s`` deadline so the queue sheds it; the local tier
   keeps its reserved headroom (``tenant_headroom``, ``--headroom``).
4. **VTC only**: as (3) with no reserved headroom: what the queue's fairness alone gives.
5. **no fairness**: as (4), but both streams carry the same tenant id, so inside the
   central queue they are one FIFO — what the virtual token counter buys.
6. **contended, short steady deadline**: as (3) with fewer steady requests whose deadline
   (``--short-deadline-s``) is shorter than the flood's backlog but longer than steady's
   contended latency: does the queue's admission check let them in?

Latency is measured from each request's scheduled (Poisson) send time. To tell queueing
apart from GPU slowdown, the central queue's public ``enqueue`` is wrapped on this
instance to time each tenant's wait in it (instrumentation only; the router's code is
unchanged), every GPU's batch and engine FIFO are sampled every 20 ms, and the engines'
token counters give the share of GPU time spent prefilling.

    .venv/bin/python -m bench.fairness              # full run (~2.5 min), writes results
    .venv/bin/python -m bench.fairness --steady-requests 150 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.report import machine, pct, revision
from common.basics.redis_embed import EmbeddedRedis
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import PRIORITY, TENANT
from common.request.v2 import generate_request
from common.tier.server import TierServer
from local_lb.queue import CentralQueue
from local_lb.queue_entries import QueuedRequest
from local_lb.server import build_local_tier
from sim.engine import DECODE_STEP_BASE_S, DECODE_STEP_PER_SEQ_S, PREFILL_S_PER_TOKEN
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers

MODEL = "bench-llm"
REGION, ZONE = "bench", "bench-1a"
STEADY, FLOOD, SHARED = "steady", "flood", "shared"
PROMPT_WORDS = 16
WORDS = (
    "route queue tenant share token batch slot model zone region deadline weight fair "
    "flood steady prompt cache decode prefill counter virtual latency capacity"
).split()
SAMPLE_EVERY_S = 0.02
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------- the zone


def zone_topology(redis_url: str, gpus: int, slots: int, health_interval_s: float) -> Topology:
    tenants = [{"id": t, "api_key_sha256": [], "weight": 1.0} for t in (STEADY, FLOOD)]
    return topology_from_mapping(
        one_zone_mapping(
            redis_url,
            gpus=gpus,
            model=MODEL,
            max_concurrency=slots,
            region=REGION,
            zone=ZONE,
            slow_start_window_s=0,
            health_interval_s=health_interval_s,
            auth={"enabled": False, "tenants": tenants},
        )
    )


class QueueProbe:
    """Times each tenant's waits in the central queue by wrapping ``enqueue`` on this
    instance (``close`` restores it). Records only; never changes an entry."""

    def __init__(self, queue: CentralQueue) -> None:
        self.queue = queue
        self.waits: dict[str, list[float]] = defaultdict(list)
        self.failed: Counter[str] = Counter()
        self._real = queue.enqueue
        setattr(queue, "enqueue", self._enqueue)  # noqa: B010 (instance attribute on purpose)

    def _enqueue(self, **kwargs: Any) -> QueuedRequest:
        ticket = self._real(**kwargs)
        tenant, start = kwargs["tenant"], time.monotonic()

        def done(future: asyncio.Future[str]) -> None:
            if future.cancelled() or future.exception() is not None:
                self.failed[tenant] += 1
            else:
                self.waits[tenant].append(time.monotonic() - start)

        ticket.future.add_done_callback(done)
        return ticket

    def reset(self) -> None:
        self.waits.clear()
        self.failed.clear()

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            delattr(self.queue, "enqueue")


class Monitor:
    """Every 20 ms: the GPUs' running batch and engine FIFO, the central queue's depth,
    and the event loop's lag (how late this sampler wakes). Over a recording window,
    also the share of GPU time spent prefilling (from the engines' token counters)."""

    def __init__(self, workers: ZoneWorkers, queue: CentralQueue) -> None:
        self.workers = list(workers)
        self.queue = queue
        self.batches: list[float] = []
        self.fifo: list[int] = []
        self.depths: list[int] = []
        self.lags: list[float] = []
        self.prefill_share = 0.0
        self.recording = False
        self._since = (0.0, 0.0)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fairness-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def record(self, on: bool) -> None:
        if on:
            for series in (self.batches, self.fifo, self.depths, self.lags):
                series.clear()
            self._since = (time.monotonic(), self._prefill_s())
        else:
            began, prefill = self._since
            wall = (time.monotonic() - began) * len(self.workers)
            self.prefill_share = (self._prefill_s() - prefill) / wall if wall > 0 else 0.0
        self.recording = on

    def _prefill_s(self) -> float:
        """GPU seconds the engines have spent prefilling uncached prompt tokens so far."""
        total = 0.0
        for w in self.workers:
            engine = w.engine
            tokens = engine.prompt_tokens_total - engine.prefix_cache_hit_tokens
            total += tokens * PREFILL_S_PER_TOKEN * engine.time_scale / engine.gpu.speed
        return total

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + SAMPLE_EVERY_S
            await asyncio.sleep(SAMPLE_EVERY_S)
            if self.recording:
                self.lags.append(max(0.0, loop.time() - due))
                self.batches.append(statistics.fmean(w.engine.running for w in self.workers))
                self.fifo.append(sum(w.engine.waiting for w in self.workers))
                self.depths.append(len(self.queue))


# ---------------------------------------------------------------------- load


@dataclass(frozen=True)
class Sample:
    stream: str
    intended: float
    sent: float
    done: float
    code: str

    @property
    def latency_s(self) -> float:
        return self.done - self.intended


def prompt(rng: random.Random, stream: str, index: int) -> str:
    """A prompt no other request shares (no prefix-cache effects)."""
    words = [rng.choice(WORDS) for _ in range(PROMPT_WORDS - 2)]
    return " ".join([stream, str(index), *words])


async def _one(
    stub: pb_grpc.GRPCInferenceServiceStub,
    request: Any,
    metadata: tuple[tuple[str, str], ...],
    timeout: float,
    stream: str,
    intended: float,
    out: list[Sample],
) -> None:
    loop = asyncio.get_running_loop()
    sent = loop.time()
    try:
        await stub.ModelInfer(request, metadata=metadata, timeout=timeout)
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    out.append(Sample(stream, intended, sent, loop.time(), code))


async def open_loop(
    stubs: Sequence[pb_grpc.GRPCInferenceServiceStub],
    *,
    stream: str,
    tenant_id: str,
    rate: float,
    count: int,
    t0: float,
    seed: int,
    timeout: float,
    max_tokens: int,
    out: list[Sample],
    stop: asyncio.Event | None = None,
) -> None:
    """``count`` Poisson arrivals at ``rate``/s from ``t0`` (fewer if ``stop`` is set);
    returns when every request sent has finished (each is bounded by ``timeout``)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    metadata = ((TENANT, tenant_id), (PRIORITY, "standard"))
    tasks: set[asyncio.Task[None]] = set()
    at = t0
    for i in range(count):
        at += rng.expovariate(rate)
        request = generate_request(MODEL, prompt(rng, stream, i), max_tokens)
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if stop is not None and stop.is_set():
            break
        stub = stubs[i % len(stubs)]
        task = asyncio.create_task(_one(stub, request, metadata, timeout, stream, at, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def calibrate(
    stub: pb_grpc.GRPCInferenceServiceStub,
    clients: int,
    warm_s: float,
    measure_s: float,
    max_tokens: int,
) -> float:
    """Requests/s the zone finishes with every slot busy (closed loop, clients > slots)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(0)
    t0 = loop.time()
    begin, end = t0 + warm_s, t0 + warm_s + measure_s
    finished: list[float] = []
    metadata = ((TENANT, "calibration"), (PRIORITY, "standard"))

    async def client(index: int) -> None:
        n = 0
        while loop.time() < end:
            request = generate_request(MODEL, prompt(rng, f"c{index}", n), max_tokens)
            n += 1
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.ModelInfer(request, metadata=metadata, timeout=30)
                finished.append(loop.time())

    await asyncio.gather(*(client(i) for i in range(clients)))
    return sum(1 for t in finished if begin <= t < end) / measure_s


async def settle(tier: TierServer, timeout_s: float = 10.0) -> None:
    """Until nothing is queued or in flight at the tier (bounded)."""
    balancer: Any = tier.balancer
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not len(balancer.queue) and balancer.view.inflight_total == 0:
            return
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------- one phase


@dataclass(frozen=True)
class Stream:
    sent: int
    codes: dict[str, int]
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def stream_stats(samples: Sequence[Sample]) -> Stream:
    ok = [s.latency_s * 1000 for s in samples if s.code == "OK"]
    return Stream(
        sent=len(samples),
        codes=dict(Counter(s.code for s in samples).most_common()),
        p50_ms=statistics.median(ok) if ok else None,
        p99_ms=pct(ok, 0.99),
        max_ms=max(ok) if ok else None,
    )


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    steady_id: str
    flood_id: str | None  # None: steady alone
    steady_requests: int
    steady_deadline_s: float
    # The local tier's tenant_headroom in this run (None: the topology's default).
    headroom: float | None = None


@dataclass(frozen=True)
class Phase:
    name: str
    steady_tenant_id: str
    flood_tenant_id: str | None
    steady_deadline_s: float
    headroom: float
    steady: Stream
    flood: Stream | None
    # Requests of either tenant finished OK per second while steady was sending.
    zone_ok_rps: float
    # Steady's waits in the central queue (None when both streams share one tenant id).
    steady_queued: int | None
    steady_queue_wait_p50_ms: float | None
    steady_queue_wait_p99_ms: float | None
    # Flood requests granted a slot from the queue, and those that expired waiting in it.
    flood_granted: int | None
    flood_expired_in_queue: int | None
    mean_gpu_batch: float
    mean_gpu_fifo: float  # requests waiting inside the GPU engines (behind a full batch)
    gpu_prefill_share: float  # of GPU time, prefilling admitted requests (stalls the batch)
    mean_queue_depth: float
    send_lag_p99_ms: float
    loop_lag_p99_ms: float
    process_cpu_cores: float
    seconds: float


@dataclass
class Rig:
    tier: TierServer
    probe: QueueProbe
    monitor: Monitor
    steady_stubs: list[pb_grpc.GRPCInferenceServiceStub]
    flood_stubs: list[pb_grpc.GRPCInferenceServiceStub]
    args: argparse.Namespace
    default_headroom: float = 0.0
    capacity_rps: float = 0.0
    phases: list[Phase] = field(default_factory=list)


async def run_phase(rig: Rig, spec: PhaseSpec) -> Phase:
    args = rig.args
    loop = asyncio.get_running_loop()
    steady_rate = args.steady_share * rig.capacity_rps
    flood_rate = args.flood_x * rig.capacity_rps / 2  # 2 tenants of equal weight
    samples: list[Sample] = []
    stop = asyncio.Event()
    t0 = loop.time() + 0.05
    steady_t0 = t0 + (args.flood_lead_s if spec.flood_id else 0.0)
    flood_task = None
    rig.probe.reset()
    tenants = rig.tier.balancer.tenants  # type: ignore[attr-defined]
    tenants.headroom = rig.default_headroom if spec.headroom is None else spec.headroom
    if spec.flood_id is not None:
        span = args.flood_lead_s + 1.5 * spec.steady_requests / steady_rate + 2.0
        flood_task = asyncio.create_task(
            open_loop(
                rig.flood_stubs,
                stream=FLOOD,
                tenant_id=spec.flood_id,
                rate=flood_rate,
                count=math.ceil(flood_rate * span),
                t0=t0,
                seed=args.seed + 1,
                timeout=args.flood_deadline_s,
                max_tokens=args.max_tokens,
                out=samples,
                stop=stop,
            )
        )
    try:
        await asyncio.sleep(max(0.0, steady_t0 - loop.time()))
        rig.monitor.record(True)
        cpu0, wall0, window_start = time.process_time(), time.monotonic(), loop.time()
        await open_loop(
            rig.steady_stubs,
            stream=STEADY,
            tenant_id=spec.steady_id,
            rate=steady_rate,
            count=spec.steady_requests,
            t0=steady_t0,
            seed=args.seed,
            timeout=spec.steady_deadline_s,
            max_tokens=args.max_tokens,
            out=samples,
        )
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        window = (window_start, loop.time())
        rig.monitor.record(False)
    finally:
        stop.set()
        if flood_task is not None:
            await flood_task
    await settle(rig.tier)
    steady = [s for s in samples if s.stream == STEADY]
    flood = [s for s in samples if s.stream == FLOOD]
    # With one shared tenant id the probe cannot tell the streams apart.
    split = spec.steady_id != spec.flood_id
    waits = rig.probe.waits.get(spec.steady_id, []) if split else []
    probe, mon = rig.probe, rig.monitor
    return Phase(
        name=spec.name,
        steady_tenant_id=spec.steady_id,
        flood_tenant_id=spec.flood_id,
        steady_deadline_s=spec.steady_deadline_s,
        headroom=tenants.headroom,
        steady=stream_stats(steady),
        flood=stream_stats(flood) if spec.flood_id is not None else None,
        zone_ok_rps=sum(1 for s in samples if s.code == "OK" and window[0] <= s.done <= window[1])
        / max(1e-9, window[1] - window[0]),
        steady_queued=len(waits) + probe.failed.get(spec.steady_id, 0) if split else None,
        steady_queue_wait_p50_ms=1000 * statistics.median(waits) if waits else None,
        steady_queue_wait_p99_ms=1000 * (pct(waits, 0.99) or 0.0) if waits else None,
        flood_granted=(
            len(probe.waits.get(spec.flood_id, [])) if split and spec.flood_id else None
        ),
        flood_expired_in_queue=(
            probe.failed.get(spec.flood_id, 0) if split and spec.flood_id else None
        ),
        mean_gpu_batch=statistics.fmean(mon.batches) if mon.batches else 0.0,
        mean_gpu_fifo=statistics.fmean(mon.fifo) if mon.fifo else 0.0,
        gpu_prefill_share=mon.prefill_share,
        mean_queue_depth=statistics.fmean(mon.depths) if mon.depths else 0.0,
        send_lag_p99_ms=1000 * (pct([s.sent - s.intended for s in steady], 0.99) or 0.0),
        loop_lag_p99_ms=1000 * (pct(mon.lags, 0.99) or 0.0),
        process_cpu_cores=cpu / wall if wall > 0 else 0.0,
        seconds=wall,
    )


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def describe(phase: Phase) -> str:
    s = phase.steady
    line = (
        f"    steady P50 {_ms(s.p50_ms)} ms, P99 {_ms(s.p99_ms)} ms, {s.codes}; "
        f"its queue wait P50 {_ms(phase.steady_queue_wait_p50_ms)} ms, "
        f"P99 {_ms(phase.steady_queue_wait_p99_ms)} ms\n"
        f"    GPU batch {phase.mean_gpu_batch:.1f}, GPU FIFO {phase.mean_gpu_fifo:.1f}, "
        f"prefill {100 * phase.gpu_prefill_share:.0f} % of GPU time, "
        f"queue {phase.mean_queue_depth:.0f}, loop lag P99 {phase.loop_lag_p99_ms:.1f} ms, "
        f"cpu {phase.process_cpu_cores:.2f} cores"
    )
    if phase.flood is not None:
        line += (
            f"\n    flood sent {phase.flood.sent}: {phase.flood.codes}; from the queue: "
            f"{phase.flood_granted} granted, {phase.flood_expired_in_queue} expired"
        )
    return line


def phase_specs(args: argparse.Namespace) -> list[PhaseSpec]:
    n, deadline = args.steady_requests, args.steady_deadline_s
    specs = [
        PhaseSpec("alone", STEADY, None, n, deadline),
        PhaseSpec("contended", STEADY, FLOOD, n, deadline),
        PhaseSpec("contended, VTC only (no headroom)", STEADY, FLOOD, n, deadline, 0.0),
        PhaseSpec("no fairness", SHARED, SHARED, n, deadline, 0.0),
    ]
    if args.short_deadline_requests:
        specs.append(
            PhaseSpec(
                f"contended, steady deadline {args.short_deadline_s:g} s",
                STEADY,
                FLOOD,
                args.short_deadline_requests,
                args.short_deadline_s,
            )
        )
    return specs


async def bench(args: argparse.Namespace) -> Rig:
    async with contextlib.AsyncExitStack() as stack:
        redis = EmbeddedRedis()
        stack.callback(redis.close)
        redis.start()
        topo = zone_topology(redis.url, args.gpus, args.slots, args.health_interval_s)
        zone = topo.zone(REGION, ZONE)
        workers = ZoneWorkers(zone, region=REGION, time_scale=args.time_scale)
        await workers.start()
        stack.push_async_callback(workers.stop, 0)
        tier = build_local_tier(topo, REGION, ZONE)
        await tier.start()
        stack.push_async_callback(tier.stop, 0)
        balancer: Any = tier.balancer
        probe = QueueProbe(balancer.queue)
        stack.callback(probe.close)
        monitor = Monitor(workers, balancer.queue)
        monitor.start()
        stack.push_async_callback(monitor.stop)

        def stubs(n: int) -> list[pb_grpc.GRPCInferenceServiceStub]:
            out = []
            for _ in range(n):
                channel = grpc.aio.insecure_channel(zone.endpoint.address, CHANNEL_OPTIONS)
                stack.push_async_callback(channel.close)
                out.append(pb_grpc.GRPCInferenceServiceStub(channel))
            return out

        headroom = topo.tenant_headroom if args.headroom is None else args.headroom
        rig = Rig(tier, probe, monitor, stubs(1), stubs(4), args, headroom)
        await asyncio.sleep(1.0)  # the monitor's first health check and metrics scrape
        slots = args.gpus * args.slots
        clients = slots + slots // 4
        print(f"calibrating: {clients} closed-loop clients over {slots} slots ...", flush=True)
        rig.capacity_rps = await calibrate(
            rig.steady_stubs[0], clients, args.calibrate_warm_s, args.calibrate_s, args.max_tokens
        )
        await settle(tier)
        print(
            f"    C = {rig.capacity_rps:.1f} requests/s; steady at "
            f"{args.steady_share * rig.capacity_rps:.1f}/s, flood at "
            f"{args.flood_x * rig.capacity_rps / 2:.1f}/s",
            flush=True,
        )
        for spec in phase_specs(args):
            print(f"{spec.name}: {spec.steady_requests} steady requests ...", flush=True)
            phase = await run_phase(rig, spec)
            rig.phases.append(phase)
            print(describe(phase), flush=True)
    return rig


# ---------------------------------------------------------------------- report


def ratio(phase: Phase, alone: Phase) -> float | None:
    if phase.steady.p99_ms is None or not alone.steady.p99_ms:
        return None
    return phase.steady.p99_ms / alone.steady.p99_ms


def decode_ms(batch: float, tokens: int, time_scale: float) -> float:
    """The emulated A100's decode time for ``tokens`` at a steady ``batch`` (sim.engine)."""
    return 1000 * tokens * (DECODE_STEP_BASE_S + DECODE_STEP_PER_SEQ_S * batch) * time_scale


def decomposition(rig: Rig, index: int) -> list[tuple[str, float | None, float | None]]:
    """Steady's contended latency as alone + the GPU's slowdown + queue wait + the rest.

    The GPU's part follows ``sim.engine``'s cost model: each decode step takes longer
    with a larger batch, and a step that admits requests also prefills their prompts,
    stalling every sequence in the batch (no chunked prefill), so a request's decode
    time stretches by 1 / (1 - share of GPU time spent prefilling)."""
    alone, contended = rig.phases[0], rig.phases[index]
    tokens, scale = rig.args.max_tokens, rig.args.time_scale
    decode_a = decode_ms(alone.mean_gpu_batch, tokens, scale)
    decode_c = decode_ms(contended.mean_gpu_batch, tokens, scale)
    pa, pc = alone.gpu_prefill_share, contended.gpu_prefill_share
    prefill = decode_c * pc / (1 - pc) - decode_a * pa / (1 - pa)
    rows: list[tuple[str, float | None, float | None]] = [
        ("steady alone", alone.steady.p50_ms, alone.steady.p99_ms),
        (
            f"+ decode at GPU batch {contended.mean_gpu_batch:.1f} instead of "
            f"{alone.mean_gpu_batch:.1f} ({tokens} steps)",
            decode_c - decode_a,
            decode_c - decode_a,
        ),
        (
            f"+ other requests' prefill stalling the batch ({100 * pc:.0f} % of GPU time "
            f"instead of {100 * pa:.0f} %)",
            prefill,
            prefill,
        ),
        (
            "+ wait in the central queue (measured)",
            contended.steady_queue_wait_p50_ms,
            contended.steady_queue_wait_p99_ms,
        ),
    ]

    def rest(total: float | None, parts: list[float | None]) -> float | None:
        known = [v for v in parts if v is not None]
        return None if total is None or len(known) < len(parts) else total - sum(known)

    rows.append(
        (
            "+ the rest (difference)",
            rest(contended.steady.p50_ms, [row[1] for row in rows]),
            rest(contended.steady.p99_ms, [row[2] for row in rows]),
        )
    )
    rows.append(("= steady contended", contended.steady.p50_ms, contended.steady.p99_ms))
    return rows


def markdown(rig: Rig, info: dict[str, Any], target: float) -> str:
    args, phases = rig.args, rig.phases
    alone = phases[0]
    lines = [
        "# Tenant fairness in the local tier's central queue",
        "",
        f"{info['date']} · {info['cpu']} · nproc {info['nproc']} · "
        f"{info['implementation']} {info['python']} · commit {info['commit']}"
        f"{' (uncommitted changes)' if info['dirty'] else ''} · load avg "
        f"{info['loadavg_1m_start']:.1f} → {info['loadavg_1m_end']:.1f}",
        "",
        f"One local tier in-process over {args.gpus} emulated A100s × {args.slots} slots "
        f"(time scale {args.time_scale:g}), requests of {PROMPT_WORDS} prompt + "
        f"{args.max_tokens} new tokens sent straight to its V2 endpoint. Capacity "
        f"C = **{rig.capacity_rps:.1f} requests/s** (closed loop, every slot busy). "
        f"`steady` sends Poisson at {args.steady_share:g} × C (deadline "
        f"{args.steady_deadline_s:g} s unless the run says otherwise); `flood` sends Poisson at "
        f"{args.flood_x:g} × its fair share (C / 2) with a {args.flood_deadline_s:g} s deadline, "
        f"from {args.flood_lead_s:g} s before steady's first request until its last. Both "
        "tenants weigh 1. *No fairness*: both streams send the same tenant id, so the queue is "
        "one FIFO. Latency from each request's scheduled send time, OK requests only.",
        "",
        "| run | headroom | steady sent | steady P50 ms | steady P99 ms | P99 / alone | "
        "steady queued | its queue wait P50 / P99 ms | zone OK/s | GPU batch | GPU prefill | "
        "GPU FIFO | queue depth | loop lag P99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        r = ratio(p, alone)
        queued = "—" if p.steady_queued is None else str(p.steady_queued)
        lines.append(
            f"| {p.name} | {p.headroom:g} | {p.steady.sent} | {_ms(p.steady.p50_ms)} | "
            f"{_ms(p.steady.p99_ms)} | {'—' if r is None else f'{r:.2f}'} | {queued} | "
            f"{_ms(p.steady_queue_wait_p50_ms)} / {_ms(p.steady_queue_wait_p99_ms)} | "
            f"{p.zone_ok_rps:.1f} | {p.mean_gpu_batch:.1f} | {100 * p.gpu_prefill_share:.0f} % | "
            f"{p.mean_gpu_fifo:.1f} | {p.mean_queue_depth:.0f} | "
            f"{p.loop_lag_p99_ms:.1f} |"
        )
    lines += [
        "",
        "Outcomes (gRPC status: count). *Granted* / *expired*: flood requests that got a slot "
        "from the central queue / whose deadline passed waiting in it.",
        "",
        "| run | steady | flood sent | flood | flood granted | flood expired |",
        "|---|---|---:|---|---:|---:|",
    ]
    for p in phases:
        flood = p.flood
        lines.append(
            f"| {p.name} | {_codes(p.steady)} | {flood.sent if flood else 0} | "
            f"{_codes(flood) if flood else '—'} | {_count(p.flood_granted)} | "
            f"{_count(p.flood_expired_in_queue)} |"
        )
    r = ratio(phases[1], alone)
    verdict = "met" if r is not None and r <= target else "missed"
    lines += [
        "",
        f"**Steady P99 contended / alone = {'—' if r is None else f'{r:.2f}'}** "
        f"(target ≤ {target:g}: {verdict}); without fairness "
        f"{_ratio(ratio(phases[3], alone))}.",
        "",
        "Where steady's extra latency comes from. The GPU rows follow the emulated GPU's "
        "cost model (`sim.engine`) at the measured mean batch and prefill share; the queue "
        "row is measured; percentiles of parts do not add exactly, and *the rest* is what "
        "is left (GPU FIFO behind slots still held by cancelled requests, gRPC, event loop):",
    ]
    for index in (1, 2):
        lines += ["", f"*{phases[index].name}*:", "", "| | P50 ms | P99 ms |", "|---|---:|---:|"]
        lines += [
            f"| {name} | {_ms(p50)} | {_ms(p99)} |" for name, p50, p99 in decomposition(rig, index)
        ]
    lines += ["", "Diagnosis and what would fix it: `bench/README.md` (fairness)."]
    return "\n".join(lines) + "\n"


def _codes(stream: Stream) -> str:
    return ", ".join(f"{code} {n}" for code, n in stream.codes.items()) or "—"


def _count(value: int | None) -> str:
    return "—" if value is None else str(value)


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument(
        "--headroom", type=float, default=None, help="tenant_headroom (default: the topology's)"
    )
    parser.add_argument("--slots", type=int, default=16, help="max_concurrency per GPU")
    parser.add_argument("--time-scale", type=float, default=2.0, help="emulated GPU slowness")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--health-interval-s", type=float, default=2.0, help="GPU health/metrics poll"
    )
    parser.add_argument("--steady-requests", type=int, default=600)
    parser.add_argument("--steady-share", type=float, default=0.4, help="steady rate / C")
    parser.add_argument("--steady-deadline-s", type=float, default=10.0)
    parser.add_argument("--flood-x", type=float, default=10.0, help="flood rate / fair share")
    parser.add_argument("--flood-deadline-s", type=float, default=3.0)
    parser.add_argument("--flood-lead-s", type=float, default=3.0, help="flood runs alone first")
    parser.add_argument(
        "--short-deadline-requests",
        type=int,
        default=100,
        help="steady requests of the extra contended run with a short deadline (0: skip it)",
    )
    parser.add_argument("--short-deadline-s", type=float, default=2.5)
    parser.add_argument("--calibrate-warm-s", type=float, default=3.0)
    parser.add_argument("--calibrate-s", type=float, default=5.0)
    parser.add_argument("--target", type=float, default=1.2, help="P99 ratio goal")
    parser.add_argument("--budget-s", type=float, default=240.0, help="hard limit, whole run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    began = time.monotonic()
    load_start = os.getloadavg()[0]  # other work on the machine skews every figure here

    async def bounded() -> Rig:
        return await asyncio.wait_for(bench(args), timeout=args.budget_s)

    try:
        rig = asyncio.run(bounded())
    except TimeoutError:
        sys.exit(f"fairness: gave up after --budget-s {args.budget_s:.0f} s (all stopped)")
    info = {
        **machine(),
        **revision(),
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0],
    }
    table = markdown(rig, info, args.target)
    print()
    print(table)
    print(f"(whole run: {time.monotonic() - began:.0f} s)")
    if args.no_write:
        return
    RESULTS.mkdir(exist_ok=True)
    alone = rig.phases[0]
    payload = {
        "benchmark": "fairness",
        "machine": info,
        "config": {**vars(args), "prompt_words": PROMPT_WORDS, "model": MODEL},
        "capacity_rps": rig.capacity_rps,
        "phases": [asdict(p) for p in rig.phases],
        "p99_ratio_contended_vs_alone": ratio(rig.phases[1], alone),
        "p99_ratio_vtc_only_vs_alone": ratio(rig.phases[2], alone),
        "p99_ratio_no_fairness_vs_alone": ratio(rig.phases[3], alone),
        "decomposition_ms": {
            rig.phases[index].name: [
                {"part": name, "p50": p50, "p99": p99}
                for name, p50, p99 in decomposition(rig, index)
            ]
            for index in (1, 2)
        },
        "target": args.target,
    }
    (RESULTS / "fairness.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / "fairness.md").write_text(table)
    print(f"wrote {RESULTS / 'fairness.json'} and {RESULTS / 'fairness.md'}")


if __name__ == "__main__":
    main()
