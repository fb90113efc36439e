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
   request with a ``--flood-deadline-s`` deadline so the queue sheds it.
4. **no fairness**: as (3), but both streams carry the same tenant id, so inside the
   central queue they are one FIFO — what the virtual token counter buys.

Latency is measured from each request's scheduled (Poisson) send time. The central
queue's public ``enqueue`` is wrapped on this instance to time each tenant's wait in it
(instrumentation only; the router's code is unchanged), and every GPU's running batch is
sampled every 20 ms, to tell queueing apart from batch slowdown.

    /tmp/venvtest/bin/python -m bench.fairness              # full run (~1.5 min), writes results
    /tmp/venvtest/bin/python -m bench.fairness --steady-requests 150 --no-write
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
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.pick_time import machine
from common.config import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.redis_embed import EmbeddedRedis, free_port
from common.routing import PRIORITY, TENANT
from common.tier import TierServer
from common.v2 import generate_request
from local_lb.queue import CentralQueue, QueuedRequest
from local_lb.server import build_local_tier
from sim.engine import step_cost_s
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
    return topology_from_mapping(
        {
            "redis_url": redis_url,
            "slow_start_window_s": 0,
            "health_interval_s": health_interval_s,
            "global": {"listen": "127.0.0.1:1", "location": {"lat": 0, "lon": 0}},
            "auth": {
                "enabled": False,
                "tenants": [
                    {"id": STEADY, "api_key_sha256": [], "weight": 1.0},
                    {"id": FLOOD, "api_key_sha256": [], "weight": 1.0},
                ],
            },
            "regions": [
                {
                    "name": REGION,
                    "location": {"lat": 0, "lon": 0},
                    "listen": "127.0.0.1:2",
                    "zones": [
                        {
                            "name": ZONE,
                            "listen": f"127.0.0.1:{free_port()}",
                            "gpus": [
                                {
                                    "name": f"g{i}",
                                    "hardware": "A100",
                                    "models": [MODEL],
                                    "max_concurrency": slots,
                                    "listen": f"127.0.0.1:{free_port()}",
                                    "metrics_listen": f"127.0.0.1:{free_port()}",
                                }
                                for i in range(gpus)
                            ],
                        }
                    ],
                }
            ],
        }
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
    """Every 20 ms: each GPU's running batch, the queue depth and the event loop's lag."""

    def __init__(self, workers: ZoneWorkers, queue: CentralQueue) -> None:
        self.workers = list(workers)
        self.queue = queue
        self.batches: list[float] = []
        self.depths: list[int] = []
        self.lags: list[float] = []
        self.recording = False
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
            self.batches.clear()
            self.depths.clear()
            self.lags.clear()
        self.recording = on

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + SAMPLE_EVERY_S
            await asyncio.sleep(SAMPLE_EVERY_S)
            if self.recording:
                self.lags.append(max(0.0, loop.time() - due))
                self.batches.append(statistics.fmean(w.engine.running for w in self.workers))
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


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


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
class Phase:
    name: str
    steady_tenant_id: str
    flood_tenant_id: str | None
    steady: Stream
    flood: Stream | None
    # Steady's waits in the central queue (None when both streams share one tenant id).
    steady_queued: int | None
    steady_queue_wait_p50_ms: float | None
    steady_queue_wait_p99_ms: float | None
    mean_gpu_batch: float
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
    capacity_rps: float = 0.0
    phases: list[Phase] = field(default_factory=list)


async def run_phase(rig: Rig, name: str, steady_id: str, flood_id: str | None) -> Phase:
    args = rig.args
    loop = asyncio.get_running_loop()
    steady_rate = args.steady_share * rig.capacity_rps
    flood_rate = args.flood_x * rig.capacity_rps / 2  # 2 tenants of equal weight
    samples: list[Sample] = []
    stop = asyncio.Event()
    t0 = loop.time() + 0.05
    steady_t0 = t0 + (args.flood_lead_s if flood_id else 0.0)
    flood_task = None
    if flood_id is not None:
        span = args.flood_lead_s + 1.5 * args.steady_requests / steady_rate + 2.0
        flood_task = asyncio.create_task(
            open_loop(
                rig.flood_stubs,
                stream=FLOOD,
                tenant_id=flood_id,
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
        rig.probe.reset()
        rig.monitor.record(True)
        cpu0, wall0 = time.process_time(), time.monotonic()
        await open_loop(
            rig.steady_stubs,
            stream=STEADY,
            tenant_id=steady_id,
            rate=steady_rate,
            count=args.steady_requests,
            t0=steady_t0,
            seed=args.seed,
            timeout=args.steady_deadline_s,
            max_tokens=args.max_tokens,
            out=samples,
        )
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        rig.monitor.record(False)
    finally:
        stop.set()
        if flood_task is not None:
            await flood_task
    await settle(rig.tier)
    steady = [s for s in samples if s.stream == STEADY]
    flood = [s for s in samples if s.stream == FLOOD]
    waits = rig.probe.waits.get(steady_id, []) if steady_id != flood_id else []
    shared = steady_id == flood_id
    mon = rig.monitor
    return Phase(
        name=name,
        steady_tenant_id=steady_id,
        flood_tenant_id=flood_id,
        steady=stream_stats(steady),
        flood=stream_stats(flood) if flood_id is not None else None,
        steady_queued=None if shared else len(waits) + rig.probe.failed.get(steady_id, 0),
        steady_queue_wait_p50_ms=None if shared or not waits else 1000 * statistics.median(waits),
        steady_queue_wait_p99_ms=None if shared or not waits else 1000 * (pct(waits, 0.99) or 0),
        mean_gpu_batch=statistics.fmean(mon.batches) if mon.batches else 0.0,
        mean_queue_depth=statistics.fmean(mon.depths) if mon.depths else 0.0,
        send_lag_p99_ms=1000 * (pct([s.sent - s.intended for s in steady], 0.99) or 0.0),
        loop_lag_p99_ms=1000 * (pct(mon.lags, 0.99) or 0.0),
        process_cpu_cores=cpu / wall if wall > 0 else 0.0,
        seconds=wall,
    )


def describe(phase: Phase) -> str:
    s = phase.steady
    line = (
        f"    steady P50 {s.p50_ms or 0:.0f} ms, P99 {s.p99_ms or 0:.0f} ms, "
        f"{s.codes}; queue wait P50 {phase.steady_queue_wait_p50_ms or 0:.0f} ms "
        f"P99 {phase.steady_queue_wait_p99_ms or 0:.0f} ms; batch {phase.mean_gpu_batch:.1f}, queue {phase.mean_queue_depth:.0f}, "
        f"loop lag P99 {phase.loop_lag_p99_ms:.1f} ms, cpu {phase.process_cpu_cores:.2f} cores"
    )
    if phase.flood is not None:
        line += f"\n    flood sent {phase.flood.sent}: {phase.flood.codes}"
    return line


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

        rig = Rig(tier, probe, monitor, stubs(1), stubs(4), args)
        await asyncio.sleep(1.0)  # the monitor's first health check and metrics scrape
        slots = args.gpus * args.slots
        print(f"calibrating: {slots + slots // 4} closed-loop clients over {slots} slots ...")
        rig.capacity_rps = await calibrate(
            rig.steady_stubs[0], slots + slots // 4, args.calibrate_warm_s,
            args.calibrate_s, args.max_tokens,
        )
        await settle(tier)
        print(
            f"    C = {rig.capacity_rps:.1f} requests/s; steady at "
            f"{args.steady_share * rig.capacity_rps:.1f}/s, flood at "
            f"{args.flood_x * rig.capacity_rps / 2:.1f}/s",
            flush=True,
        )
        for name, steady_id, flood_id in (
            ("alone", STEADY, None),
            ("contended", STEADY, FLOOD),
            ("no fairness", SHARED, SHARED),
        ):
            print(f"{name}: {args.steady_requests} steady requests ...", flush=True)
            phase = await run_phase(rig, name, steady_id, flood_id)
            rig.phases.append(phase)
            print(describe(phase), flush=True)
    return rig


# ---------------------------------------------------------------------- report


def revision() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(
                ["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "-uno", "--porcelain")),
    }


def ratio(phase: Phase, alone: Phase) -> float | None:
    if phase.steady.p99_ms is None or not alone.steady.p99_ms:
        return None
    return phase.steady.p99_ms / alone.steady.p99_ms


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


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
        f"(time scale {args.time_scale}), requests of {PROMPT_WORDS} prompt + "
        f"{args.max_tokens} new tokens sent straight to its V2 endpoint. Capacity "
        f"C = **{rig.capacity_rps:.1f} requests/s** (closed loop, every slot busy). "
        f"`steady` sends {args.steady_requests} Poisson requests at {args.steady_share} × C "
        f"(deadline {args.steady_deadline_s:.0f} s); `flood` sends Poisson at {args.flood_x} × "
        f"its fair share (C / 2) with a {args.flood_deadline_s:.0f} s deadline, from "
        f"{args.flood_lead_s:.0f} s before steady's first request until its last. Both tenants "
        "weigh 1. *No fairness*: both streams send the same tenant id, so the queue is one FIFO. "
        "Latency from each request's scheduled send time, OK requests only.",
        "",
        "| run | steady P50 ms | steady P99 ms | P99 / alone | steady queued | "
        "its queue wait P99 ms | mean GPU batch | mean queue depth | loop lag P99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        r = ratio(p, alone)
        queued = "—" if p.steady_queued is None else f"{p.steady_queued}/{p.steady.sent}"
        lines.append(
            f"| {p.name} | {_ms(p.steady.p50_ms)} | {_ms(p.steady.p99_ms)} | "
            f"{'—' if r is None else f'{r:.2f}'} | {queued} | "
            f"{_ms(p.steady_queue_wait_p99_ms)} | {p.mean_gpu_batch:.1f} | "
            f"{p.mean_queue_depth:.0f} | {p.loop_lag_p99_ms:.1f} |"
        )
    lines += ["", "| run | steady outcomes | flood sent | flood outcomes |", "|---|---|---:|---|"]
    for p in phases:
        flood = p.flood
        codes = ", ".join(f"{k} {v}" for k, v in flood.codes.items()) if flood else "—"
        steady_codes = ", ".join(f"{k} {v}" for k, v in p.steady.codes.items())
        lines.append(f"| {p.name} | {steady_codes} | {flood.sent if flood else 0} | {codes} |")
    contended = phases[1]
    r = ratio(contended, alone)
    slowdown = step_cost_s(round(contended.mean_gpu_batch), 0) / step_cost_s(
        max(1, round(alone.mean_gpu_batch)), 0
    )
    verdict = "met" if r is not None and r <= target else "missed"
    lines += [
        "",
        f"**P99 contended / alone = {'—' if r is None else f'{r:.2f}'}** "
        f"(target ≤ {target}: {verdict}). The emulated GPU's decode step at the contended mean "
        f"batch ({contended.mean_gpu_batch:.1f}) takes {slowdown:.2f}× as long as at the "
        f"alone batch ({alone.mean_gpu_batch:.1f}) (`sim.engine.step_cost_s`): that much of "
        "the ratio is batch slowdown, which no queue order can remove; steady's own wait "
        "in the central queue is the column above.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--slots", type=int, default=16, help="max_concurrency per GPU")
    parser.add_argument("--time-scale", type=float, default=2.0, help="emulated GPU slowness")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--health-interval-s", type=float, default=2.0, help="GPU health/metrics poll"
    )
    parser.add_argument("--steady-requests", type=int, default=500)
    parser.add_argument("--steady-share", type=float, default=0.4, help="steady rate / C")
    parser.add_argument("--steady-deadline-s", type=float, default=10.0)
    parser.add_argument("--flood-x", type=float, default=10.0, help="flood rate / fair share")
    parser.add_argument("--flood-deadline-s", type=float, default=3.0)
    parser.add_argument("--flood-lead-s", type=float, default=3.0, help="flood runs alone first")
    parser.add_argument("--calibrate-warm-s", type=float, default=3.0)
    parser.add_argument("--calibrate-s", type=float, default=5.0)
    parser.add_argument("--target", type=float, default=1.2, help="P99 ratio goal")
    parser.add_argument("--budget-s", type=float, default=170.0, help="hard limit, whole run")
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
        "p99_ratio_no_fairness_vs_alone": ratio(rig.phases[2], alone),
        "target": args.target,
    }
    (RESULTS / "fairness.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / "fairness.md").write_text(table)
    print(f"wrote {RESULTS / 'fairness.json'} and {RESULTS / 'fairness.md'}")


if __name__ == "__main__":
    main()
