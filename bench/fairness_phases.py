"""The fairness bench's phases: what each run is, how one runs, and what it measured.

``open_rig`` starts the zone (embedded Redis, emulated GPUs, the local tier) and its
instruments; ``phase_specs`` lists the runs the options ask for; ``run_phase`` sends the
steady stream (and the flood, if any) and summarises the window into a ``Phase``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.fairness_load import Sample, open_loop
from bench.fairness_zone import (
    FLOOD,
    REGION,
    SHARED,
    STEADY,
    ZONE,
    Monitor,
    QueueProbe,
    settle,
    zone_topology,
)
from bench.report import pct
from common.basics.redis_embed import EmbeddedRedis
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.tier.server import TierServer
from local_lb.server import build_local_tier
from sim.worker import ZoneWorkers

CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel


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


@dataclass(frozen=True)
class Window:
    """The span steady sent in: loop-clock bounds, and this process's CPU and wall time."""

    start: float
    end: float
    cpu_s: float
    wall_s: float


async def open_rig(stack: contextlib.AsyncExitStack, args: argparse.Namespace) -> Rig:
    """The zone and its instruments, each stopped by ``stack`` when it closes."""
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
        out: list[pb_grpc.GRPCInferenceServiceStub] = []
        for _ in range(n):
            channel = grpc.aio.insecure_channel(zone.endpoint.address, CHANNEL_OPTIONS)
            stack.push_async_callback(channel.close)
            out.append(pb_grpc.GRPCInferenceServiceStub(channel))
        return out

    headroom = topo.tenant_headroom if args.headroom is None else args.headroom
    rig = Rig(tier, probe, monitor, stubs(1), stubs(4), args, headroom)
    await asyncio.sleep(1.0)  # the monitor's first health check and metrics scrape
    return rig


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


async def run_phase(rig: Rig, spec: PhaseSpec) -> Phase:
    args = rig.args
    loop = asyncio.get_running_loop()
    steady_rate = args.steady_share * rig.capacity_rps
    samples: list[Sample] = []
    stop = asyncio.Event()
    t0 = loop.time() + 0.05
    steady_t0 = t0 + (args.flood_lead_s if spec.flood_id else 0.0)
    rig.probe.reset()
    tenants = rig.tier.balancer.tenants  # type: ignore[attr-defined]
    tenants.headroom = rig.default_headroom if spec.headroom is None else spec.headroom
    flood_task = _start_flood(rig, spec, steady_rate, t0, samples, stop)
    try:
        window = await _send_steady(rig, spec, steady_rate, steady_t0, samples)
    finally:
        stop.set()
        if flood_task is not None:
            await flood_task
    await settle(rig.tier)
    return _summarise(rig, spec, tenants.headroom, samples, window)


def _start_flood(
    rig: Rig,
    spec: PhaseSpec,
    steady_rate: float,
    t0: float,
    samples: list[Sample],
    stop: asyncio.Event,
) -> asyncio.Task[None] | None:
    """The flood stream, from ``t0`` until ``stop`` is set (None when steady runs alone)."""
    if spec.flood_id is None:
        return None
    args = rig.args
    flood_rate = args.flood_x * rig.capacity_rps / 2  # 2 tenants of equal weight
    # Arrivals enough to outlast a late steady stream; ``stop`` cuts off the surplus.
    span = args.flood_lead_s + 1.5 * spec.steady_requests / steady_rate + 2.0
    return asyncio.create_task(
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


async def _send_steady(
    rig: Rig, spec: PhaseSpec, steady_rate: float, steady_t0: float, samples: list[Sample]
) -> Window:
    """Steady's whole stream, with the monitor recording only while it sends."""
    args = rig.args
    loop = asyncio.get_running_loop()
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
    window = Window(window_start, loop.time(), cpu, wall)
    rig.monitor.record(False)
    return window


def _summarise(
    rig: Rig, spec: PhaseSpec, headroom: float, samples: list[Sample], window: Window
) -> Phase:
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
        headroom=headroom,
        steady=stream_stats(steady),
        flood=stream_stats(flood) if spec.flood_id is not None else None,
        zone_ok_rps=sum(
            1 for s in samples if s.code == "OK" and window.start <= s.done <= window.end
        )
        / max(1e-9, window.end - window.start),
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
        process_cpu_cores=window.cpu_s / window.wall_s if window.wall_s > 0 else 0.0,
        seconds=window.wall_s,
    )
