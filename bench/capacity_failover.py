"""Measurements (3) and (4) of capacity_flow: traffic leaving a dead region and coming back.

(3) **failover** — closed-loop unary clients from Dublin against the global endpoint of a
2-region fleet; ``regional-eu-west`` is SIGKILLed mid-run: time until requests land in
us-east, and failed requests. (4) **return** — the regional tier is started again;
eu-west's share of completions per 250 ms after it is ready.

The load runs in a thread (and an event loop) of its own; the kill and the restart stay
on the caller's (main) thread, which started the fleet's children with PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from bench.capacity_fleet import DUBLIN, MODEL, REGION, restart_precisely
from bench.report import pct
from cli.launcher import Fleet
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import CLIENT_GEO, ROUTE, trailer
from common.request.v2 import generate_request

Bucket = tuple[float, int, float | None, float | None]


@dataclass(frozen=True)
class Call:
    start: float
    end: float
    code: str
    route: str
    detail: str


class Load(threading.Thread):
    """Closed-loop unary clients from Dublin against the global endpoint, in their own loop."""

    def __init__(self, address: str, clients: int, max_tokens: int, cap_s: float) -> None:
        super().__init__(name="load", daemon=True)
        self.address, self.clients, self.max_tokens, self.cap_s = (
            address,
            clients,
            max_tokens,
            cap_s,
        )
        self.calls: list[Call] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    async def _main(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            stop_at = time.monotonic() + self.cap_s
            await asyncio.gather(*(self._client(stub, i, stop_at) for i in range(self.clients)))

    async def _client(self, stub: Any, index: int, stop_at: float) -> None:
        metadata = ((CLIENT_GEO, DUBLIN),)
        n = 0
        while not self.halt.is_set() and time.monotonic() < stop_at:
            n += 1
            request = generate_request(MODEL, f"client {index} request {n}", self.max_tokens)
            start = time.monotonic()
            call = stub.ModelInfer(request, metadata=metadata, timeout=5.0)
            try:
                await call
                route, code, detail = trailer(await call.trailing_metadata(), ROUTE) or "", "OK", ""
            except grpc.aio.AioRpcError as exc:
                route, code, detail = "", exc.code().name, exc.details() or ""
            self.calls.append(Call(start, time.monotonic(), code, route, detail))


def buckets(calls: Sequence[Call], t0: float, t1: float, width: float, region: str) -> list[Bucket]:
    """Per bucket of completion time: (bucket end - t0, OK completions, share of them in
    ``region``, their median latency)."""
    n = max(1, round((t1 - t0) / width))
    latencies: list[list[float]] = [[] for _ in range(n)]
    hits = [0] * n
    for c in calls:
        if c.code == "OK" and t0 <= c.end < t0 + n * width:
            k = int((c.end - t0) / width)
            latencies[k].append(c.end - c.start)
            hits[k] += c.route.startswith(region + "/")
    return [
        (
            (k + 1) * width,
            len(lat),
            hits[k] / len(lat) if lat else None,
            statistics.median(lat) if lat else None,
        )
        for k, lat in enumerate(latencies)
    ]


@dataclass
class Failover:
    clients: int
    max_tokens: int
    time_scale: float
    inner_tls: bool
    requests: int
    failed: int
    failure_codes: dict[str, int]
    failure_samples: list[str]
    original_eu_share: float
    pre_kill_rps: float
    pre_kill_latency_p50_s: float | None
    pre_kill_latency_p99_s: float | None
    in_flight_at_kill: int
    failed_in_flight_at_kill: int
    failed_started_after_kill: int
    first_us_east_completion_s: float | None
    first_us_east_started_s: float | None
    move_95_s: float | None
    move_buckets_100ms: list[Bucket]
    down_latency_p50_s: float | None
    down_latency_p99_s: float | None
    regional_start_s: float
    first_eu_completion_after_ready_s: float | None
    return_buckets_250ms: list[Bucket]
    return_50_s: float | None
    return_90_s: float | None
    failed_after_ready: int


@dataclass(frozen=True)
class Timeline:
    """Every call of one failover run, by completion time, and the moments that frame them."""

    calls: list[Call]
    killed: float
    spawned: float
    ready: float


def _kill_and_restart(
    fleet: Fleet, *, clients: int, max_tokens: int, warm_s: float, down_s: float, back_s: float
) -> Timeline:
    """Kill the eu-west regional tier under Dublin load, then start it again."""
    name = f"regional-{REGION}"
    load = Load(fleet.global_address, clients, max_tokens, cap_s=warm_s + down_s + back_s + 60)
    load.start()
    try:
        time.sleep(warm_s)
        killed = time.monotonic()
        fleet.kill(name)
        time.sleep(down_s)
        spawned = time.monotonic()
        ready = restart_precisely(fleet, name, [fleet.endpoint_of(name)], 30.0)
        time.sleep(back_s + 0.3)
    finally:
        load.halt.set()
        load.join(15.0)
    if load.error is not None:
        raise load.error
    return Timeline(sorted(load.calls, key=lambda c: c.end), killed, spawned, ready)


def _settled(move: Sequence[Bucket], share: float) -> float | None:
    """End of the first bucket from which every non-empty bucket has at least ``share``."""
    for k in range(len(move)):
        if all(s is None or s >= share for _, _, s, _ in move[k:]):
            return move[k][0]
    return None


def _reach(back: Sequence[Bucket], share: float) -> float | None:
    """End of the first bucket with at least ``share``."""
    return next((t for t, _, s, _ in back if s is not None and s >= share), None)


def _failures(failed: Sequence[Call]) -> tuple[dict[str, int], list[str]]:
    """Failed calls by status code, and up to five distinct messages to read."""
    codes: dict[str, int] = {}
    for c in failed:
        codes[c.code] = codes.get(c.code, 0) + 1
    return codes, sorted({f"{c.code}: {c.detail}"[:300] for c in failed})[:5]


def _analyse(
    run: Timeline, fleet: Fleet, *, clients: int, max_tokens: int, warm_s: float, back_s: float
) -> Failover:
    """The figures of (3) and (4) from one run's calls."""
    calls, killed, spawned, ready = run.calls, run.killed, run.spawned, run.ready
    failed = [c for c in calls if c.code != "OK"]
    pre = [c for c in calls if killed - (warm_s - 1.0) <= c.end < killed and c.code == "OK"]
    eu = [c for c in pre if c.route.startswith(REGION + "/")]
    original = len(eu) / len(pre) if pre else 0.0
    to_us = next(
        (c for c in calls if c.code == "OK" and c.route.startswith("us-east/") and c.end >= killed),
        None,
    )
    move = buckets(calls, killed, spawned, 0.1, "us-east")
    back = buckets(calls, ready, ready + back_s, 0.25, REGION)
    first_eu = next(
        (
            c
            for c in calls
            if c.code == "OK" and c.end >= ready and c.route.startswith(REGION + "/")
        ),
        None,
    )
    down_lat = [
        c.end - c.start for c in calls if c.code == "OK" and killed + 1.0 <= c.start < spawned
    ]
    pre_lat = [c.end - c.start for c in pre]
    codes, samples = _failures(failed)
    return Failover(
        clients=clients,
        max_tokens=max_tokens,
        time_scale=fleet.topology.time_scale,
        inner_tls=fleet.topology.tls is not None,
        requests=len(calls),
        failed=len(failed),
        failure_codes=codes,
        failure_samples=samples,
        original_eu_share=original,
        pre_kill_rps=len(pre) / (warm_s - 1.0),
        pre_kill_latency_p50_s=pct(pre_lat, 0.5),
        pre_kill_latency_p99_s=pct(pre_lat, 0.99),
        in_flight_at_kill=sum(1 for c in calls if c.start < killed <= c.end),
        failed_in_flight_at_kill=sum(1 for c in failed if c.start < killed <= c.end),
        failed_started_after_kill=sum(1 for c in failed if c.start >= killed),
        first_us_east_completion_s=to_us.end - killed if to_us is not None else None,
        first_us_east_started_s=to_us.start - killed if to_us is not None else None,
        move_95_s=_settled(move, 0.95),
        move_buckets_100ms=move,
        down_latency_p50_s=pct(down_lat, 0.5),
        down_latency_p99_s=pct(down_lat, 0.99),
        regional_start_s=ready - spawned,
        first_eu_completion_after_ready_s=first_eu.end - ready if first_eu is not None else None,
        return_buckets_250ms=back,
        return_50_s=_reach(back, 0.5 * original),
        return_90_s=_reach(back, 0.9 * original),
        failed_after_ready=sum(1 for c in failed if c.start >= ready),
    )


def failover(
    fleet: Fleet, *, clients: int, max_tokens: int, warm_s: float, down_s: float, back_s: float
) -> Failover:
    """Kill the eu-west regional tier under Dublin load, start it again, watch traffic move."""
    run = _kill_and_restart(
        fleet, clients=clients, max_tokens=max_tokens, warm_s=warm_s, down_s=down_s, back_s=back_s
    )
    return _analyse(
        run, fleet, clients=clients, max_tokens=max_tokens, warm_s=warm_s, back_s=back_s
    )
