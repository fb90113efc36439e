"""What tracing costs the request path: a local tier with tracing off, on, and 1 in 10.

In one process: ``--gpus`` emulated A100s (``ZoneWorkers``, real gRPC on loopback, an
embedded Redis for the capacity publisher) at ``--time-scale`` (tiny: the router, not the
GPU, is the bottleneck, the worst case for a relative overhead), and a local tier per
mode over them, all serving at once: *off* (the proxy's default no-op tracer), *off,
again* (a second such tier: how far two identical tiers lie apart in the run), *on*
(``setup_tracing`` with ``OTEL_TRACES_SAMPLER=parentbased_always_on`` and the in-memory
span ring: a server, a ``pick`` and an attempt span per request, W3C context injected
into the GPU call) and *10 %* (``setup_tracing`` with no sampler variable: Meridian's 1 in
10). A closed loop of ``--concurrency`` clients sends 1-token generate requests to one
tier for ``--seconds``, then the next, ``--runs`` rounds, every other round backwards;
each window records requests/s and the process's CPU per request, and each traced window
is compared with the mean of its round's two untraced ones (the second untraced tier
against the first gives the noise floor). Short windows keep a round within one mood of
this shared machine. Then ``bench.tracing_hooks`` times tracing's own calls per
request alone, at the edge and below it, where the windows' noise cannot hide them.

    .venv/bin/python -m bench.tracing_overhead             # 40 rounds of 4 × 0.5 s, writes results
    .venv/bin/python -m bench.tracing_overhead --runs 4 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.report import machine, revision, write_json_and_markdown
from bench.tracing_hooks import chain_cost, hook_costs, no_op_tracing
from bench.tracing_report import MODES, markdown
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability.tracing import DEFAULT_SAMPLE_RATIO, Telemetry, setup_tracing
from common.request.v2 import generate_request
from local_lb.server import build_local_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers

REGION, ZONE, MODEL = "r", "r-1a", "m"
# Share of requests the edge traces in each traced mode.
SAMPLED = {"on": 1.0, "10%": DEFAULT_SAMPLE_RATIO}
RESULTS = Path(__file__).parent / "results"


def topologies(redis_url: str, gpus: int) -> dict[str, Topology]:
    """One topology per mode: the same GPUs, a zone address of its own for each mode's
    local tier (all serve at once, so windows can alternate quickly)."""
    mapping = one_zone_mapping(
        redis_url, gpus=gpus, model=MODEL, region=REGION, zone=ZONE, slow_start_window_s=0
    )
    zone = mapping["regions"][0]["zones"][0]
    out = {}
    for mode in MODES:
        zone["listen"] = f"127.0.0.1:{free_port()}"
        out[mode] = topology_from_mapping(copy.deepcopy(mapping))
    return out


@dataclass(frozen=True)
class Window:
    """One closed-loop window: requests/s, and this process's CPU per request (client,
    tier and GPUs together, every thread; unlike requests/s, it leaves out the time the
    process waited for a core)."""

    rps: float
    cpu_us: float


async def closed_loop(
    stub: pb_grpc.GRPCInferenceServiceStub, concurrency: int, seconds: float
) -> Window:
    """What ``concurrency`` clients, each sending the next request on reply, get done."""
    request = generate_request(MODEL, "hello", 1)
    done = 0
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await stub.ModelInfer(request, timeout=10)
            done += 1

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    cpu_us = (time.process_time() - cpu) / max(done, 1) * 1e6
    return Window(done / (time.perf_counter() - started), cpu_us)


def tracing_with(sampler: str | None) -> Telemetry:
    """``setup_tracing`` with ``OTEL_TRACES_SAMPLER`` set to ``sampler`` (None: unset,
    Meridian's default) just for the call; the SDK reads the variable then."""
    keys = ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")
    saved = {k: os.environ.pop(k, None) for k in keys}
    if sampler is not None:
        os.environ["OTEL_TRACES_SAMPLER"] = sampler
    try:
        return setup_tracing("bench-local")
    finally:
        for key in keys:
            os.environ.pop(key, None)
            if saved[key] is not None:
                os.environ[key] = saved[key]  # type: ignore[assignment]


def telemetry_for(mode: str) -> Telemetry:
    if mode not in SAMPLED:
        return no_op_tracing()
    # "on": every request traced; "10%": Meridian's default sampler, 1 in 10.
    return tracing_with("parentbased_always_on" if mode == "on" else None)


async def windows_by_mode(args: argparse.Namespace) -> dict[str, list[Window]]:
    """``--runs`` rounds of one window per mode, through a local tier per mode over the
    same GPUs, every other round backwards so no mode always follows the same one."""
    redis = EmbeddedRedis()
    redis.start()
    topos = topologies(redis.url, args.gpus)
    zone = topos["off"].zone(REGION, ZONE)
    workers = ZoneWorkers(zone, region=REGION, time_scale=args.time_scale)
    tiers = {
        m: build_local_tier(t, REGION, ZONE, telemetry=telemetry_for(m)) for m, t in topos.items()
    }
    windows: dict[str, list[Window]] = {mode: [] for mode in MODES}
    channels = {
        m: grpc.aio.insecure_channel(t.zone(REGION, ZONE).endpoint.address)
        for m, t in topos.items()
    }
    stubs = {m: pb_grpc.GRPCInferenceServiceStub(c) for m, c in channels.items()}
    try:
        await workers.start()
        for tier in tiers.values():
            await tier.start()
        await asyncio.sleep(0.5)  # first health checks
        for mode in MODES:
            await closed_loop(stubs[mode], args.concurrency, 1.0)  # warm up
        for i in range(args.runs):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                window = await closed_loop(stubs[mode], args.concurrency, args.seconds)
                windows[mode].append(window)
                print(
                    f"run {i + 1} tracing {mode:3s}: {window.rps:8.1f} req/s"
                    f" {window.cpu_us:7.0f} µs CPU/request",
                    flush=True,
                )
    finally:
        for channel in channels.values():
            await channel.close()
        for tier in tiers.values():
            await tier.stop(0)
        await workers.stop(0)
        redis.stop()
    return windows


def paired_pct(base: list[float], other: list[float], *, lost: bool) -> dict[str, float]:
    """How far ``other`` lies from ``base`` round by round, in % of ``base`` (``lost``:
    positive when lower, as requests/s lost; else positive when higher, as CPU added):
    the median over the rounds, and its standard error (1.2533 σ/√n, the normal
    approximation), which says how finely the run can tell."""
    sign = -1.0 if lost else 1.0
    diffs = [sign * 100.0 * (o - b) / b for b, o in zip(base, other, strict=True)]
    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    return {
        "median": statistics.median(diffs),
        "stderr": 1.2533 * spread / math.sqrt(len(diffs)),
    }


def untraced(by_mode: dict[str, list[float]]) -> list[float]:
    """Each round's mean of the two untraced windows."""
    return [(a + b) / 2 for a, b in zip(by_mode["off"], by_mode["off, again"], strict=True)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    windows = await windows_by_mode(args)
    modes = {"off": no_op_tracing(), **{mode: telemetry_for(mode) for mode in SAMPLED}}
    hooks = hook_costs(modes, args.hook_requests, args.hook_rounds)
    for telemetry in modes.values():
        telemetry.shutdown()
    rps = {mode: [w.rps for w in ws] for mode, ws in windows.items()}
    cpu = {mode: [w.cpu_us for w in ws] for mode, ws in windows.items()}
    return {
        "machine": machine(),
        "revision": revision(),
        "params": vars(args),
        "runs_rps": rps,
        "runs_cpu_us": cpu,
        "median_rps": {mode: statistics.median(v) for mode, v in rps.items()},
        "median_cpu_us": {mode: statistics.median(v) for mode, v in cpu.items()},
        # The second untraced tier against the first, round by round: the noise floor.
        "untraced_apart_pct": {
            "rps": paired_pct(rps["off"], rps["off, again"], lost=True),
            "cpu": paired_pct(cpu["off"], cpu["off, again"], lost=False),
        },
        # Each traced window against the mean of its round's two untraced ones (either
        # alone may be the faster tier of the run).
        "paired_rps_lost_pct": {
            mode: paired_pct(untraced(rps), rps[mode], lost=True) for mode in SAMPLED
        },
        "paired_cpu_added_pct": {
            mode: paired_pct(untraced(cpu), cpu[mode], lost=False) for mode in SAMPLED
        },
        "hooks_us": hooks,
        "hooks_chain_us": {
            "off": chain_cost(hooks["off"], 0.0),
            **{mode: chain_cost(hooks[mode], ratio) for mode, ratio in SAMPLED.items()},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--hook-requests", type=int, default=20000)
    parser.add_argument("--hook-rounds", type=int, default=5)
    parser.add_argument("--time-scale", type=float, default=0.001)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    text = markdown(result)
    print(text)
    if not args.no_write:
        write_json_and_markdown(RESULTS, "tracing_overhead", result, text)


if __name__ == "__main__":
    main()
