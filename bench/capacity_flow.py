"""Capacity flow and region failover, measured on real processes (a benchmark, not a test).

Four figures from one run:

1. **propagation** — a zone's worker process (both its GPUs) is killed, then
   started again, ``--cycles`` times; the delay from the change to the first
   ``meridian:capacity:region:<region>`` entry whose ``healthy_gpus`` shows it,
   read with XREAD BLOCK from here (the global tier's reader adds one XREAD
   round trip on top). The zone stream is watched too, to split the delay
   into "local tier noticed and published" and "regional tier republished".
2. **redis cost** — in-process, on a fresh embedded Redis: 125 zone publishers
   (8 GPUs each, 1000 GPUs), 16 regional readers + publishers and one global
   reader, at the 500 ms cadence; commands/s, network bytes, Redis CPU and the
   memory the streams hold at their MAXLEN.
3. **failover** — 8 closed-loop unary clients from Dublin against the global
   endpoint of a 2-region fleet; ``regional-eu-west`` is SIGKILLed mid-run:
   time until requests land in us-east, and failed requests.
4. **return** — the regional tier is started again; eu-west's share of
   completions per 250 ms after it is ready.

All process control happens on the main thread (children get PR_SET_PDEATHSIG
from the thread that started them); the load and the stream watcher run in
threads of their own. Every process started here is stopped in ``finally``.

    .venv/bin/python -m bench.capacity_flow              # full run (~2 min), writes results
    .venv/bin/python -m bench.capacity_flow --cycles 3 --redis-s 3 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis
import redis.asyncio as aioredis
import yaml

from bench.report import machine, pct, revision
from cli.launcher import DEMO_FLEET, Fleet, tier_ready
from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import (
    SUMMARY_FIELD,
    CapacityPublisher,
    CapacityReader,
    region_stream,
    zone_stream,
)
from common.capacity.summary import aggregate
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import capacity_pb2
from common.request.routing import CLIENT_GEO, ROUTE, trailer
from common.request.v2 import generate_request

MODEL = "demo-llm"
RESULTS = Path(__file__).resolve().parent / "results"
DUBLIN = "53.35,-6.26"
REGION, ZONE = "eu-west", "eu-west-1a"
READY_POLL_S = 0.01


# ---------------------------------------------------------------------- shared helpers


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f} ms"


def fleet_spec(time_scale: float) -> dict[str, Any]:
    """us-east and eu-west from the demo fleet, one zone each, two GPUs per zone, no auth."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["global"]["listen"] = "127.0.0.1:0"
    spec["time_scale"] = time_scale
    if "auth" in spec:  # as the routing tests do: this measures routing, not API keys
        spec["auth"] = {"enabled": False, "tenants": []}
    spec["regions"] = [r for r in spec["regions"] if r["name"] in ("us-east", "eu-west")]
    for region in spec["regions"]:
        region["zones"] = region["zones"][:1]
        region["zones"][0]["gpus"] = region["zones"][0]["gpus"][:2]
    return spec


def all_ready(addresses: Sequence[str], credentials: grpc.ChannelCredentials | None) -> bool:
    return all(tier_ready(a, credentials, timeout_s=0.2) for a in addresses)


def restart_precisely(fleet: Fleet, name: str, addresses: Sequence[str], timeout_s: float) -> float:
    """``Fleet.restart`` with a 10 ms readiness poll; returns when all ``addresses`` were ready."""
    proc = fleet.processes[name]
    credentials = fleet.credentials_for(name)  # inner tiers speak mutual TLS
    proc.stop()
    proc.start()
    deadline = time.monotonic() + timeout_s
    while not all_ready(addresses, credentials):
        if not proc.alive():
            raise RuntimeError(f"{name} exited at start; see {proc.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready after {timeout_s} s; see {proc.log_path}")
        time.sleep(READY_POLL_S)
    return time.monotonic()


# ---------------------------------------------------------------------- 1. propagation


class StreamWatcher(threading.Thread):
    """Follows streams with XREAD BLOCK and logs (arrival, stream, healthy_gpus)."""

    def __init__(self, url: str, streams: Sequence[str]) -> None:
        super().__init__(name="stream-watcher", daemon=True)
        self.client = redis.Redis.from_url(url, socket_timeout=2.0)
        self.last: dict[str, bytes | str] = {}
        for stream in streams:
            newest: Any = self.client.xrevrange(stream, count=1)
            self.last[stream] = newest[0][0] if newest else "0-0"
        self.log: list[tuple[float, str, int]] = []
        self.cond = threading.Condition()
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            replies: Any = self.client.xread(self.last, block=200)  # type: ignore[arg-type]
            now = time.monotonic()
            for stream, entries in replies or ():
                name = stream.decode()
                for entry_id, fields in entries:
                    self.last[name] = entry_id
                    summary = capacity_pb2.CapacitySummary.FromString(fields[SUMMARY_FIELD])
                    healthy = sum(m.healthy_gpus for m in summary.models if m.model == MODEL)
                    with self.cond:
                        self.log.append((now, name, healthy))
                        self.cond.notify_all()
        self.client.close()

    def first(self, stream: str, healthy: int, after: float, timeout_s: float) -> float | None:
        """Arrival of the first entry of ``stream`` after ``after`` with ``healthy`` GPUs."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for at, name, value in self.log:
                    if name == stream and at > after and value == healthy:
                        return at
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)


@dataclass
class Propagation:
    """Seconds from each change to its first sign in the zone and the region stream."""

    cycles: int
    down_zone_s: list[float] = field(default_factory=list)
    down_region_s: list[float] = field(default_factory=list)
    up_zone_s: list[float] = field(default_factory=list)
    up_region_s: list[float] = field(default_factory=list)
    missed: int = 0
    worker_start_s: list[float] = field(default_factory=list)


def propagation(fleet: Fleet, cycles: int, rng: random.Random) -> Propagation:
    """Kill and restart ``worker-<zone>`` ``cycles`` times; time both changes upward."""
    zone_cfg = fleet.topology.zone(REGION, ZONE)
    gpus = len(zone_cfg.gpus)
    addresses = [g.endpoint.address for g in zone_cfg.gpus]
    zs, rs = zone_stream(REGION, ZONE), region_stream(REGION)
    cadence = fleet.topology.summary_cadence_s
    worker = f"worker-{ZONE}"
    result = Propagation(cycles)
    watcher = StreamWatcher(fleet.topology.redis_url, [zs, rs])
    watcher.start()
    try:
        if watcher.first(rs, gpus, 0.0, 10.0) is None:
            raise RuntimeError(f"{rs} never showed {gpus} healthy GPUs")
        for i in range(cycles):
            time.sleep(rng.uniform(0.3, 0.3 + cadence))  # no phase lock with the cadence
            killed = time.monotonic()
            fleet.kill(worker)
            # The region may show it before the zone stream does: the regional tier also
            # watches the local tier's health, which turns NOT_SERVING with no GPU left.
            down = watcher.first(rs, 0, killed, 5.0), watcher.first(zs, 0, killed, 2.0)
            time.sleep(rng.uniform(0.2, 0.2 + cadence))
            spawned = time.monotonic()
            ready = restart_precisely(fleet, worker, addresses, 30.0)
            result.worker_start_s.append(ready - spawned)
            # After the kill every entry says 0, so the first "all healthy" after the
            # spawn is this restart's (it may even beat our 10 ms ready poll).
            up = watcher.first(rs, gpus, spawned, 8.0), watcher.first(zs, gpus, spawned, 2.0)
            line = f"  cycle {i + 1:2d}:"
            for label, (region_at, zone_at), origin, into in (
                ("down", down, killed, (result.down_region_s, result.down_zone_s)),
                ("up", up, ready, (result.up_region_s, result.up_zone_s)),
            ):
                if region_at is None:
                    result.missed += 1
                    line += f"  {label}: not seen"
                    continue
                into[0].append(region_at - origin)
                zone_s = None if zone_at is None else zone_at - origin
                if zone_s is not None:
                    into[1].append(zone_s)
                line += f"  {label}: zone {ms(zone_s):>7} region {ms(region_at - origin):>7}"
            print(line, flush=True)
    finally:
        watcher.halt.set()
        watcher.join(5.0)
    return result


# ---------------------------------------------------------------------- 2. redis cost

ZONE_MODELS = (("llama-3.1-70b", 8), ("llama-3.1-8b", 4))  # (model, GPUs serving it) per zone
SLOTS_PER_GPU = 16


def zone_builder(region: str, zone: str, rng: random.Random) -> Callable[[int], Any]:
    """What a local tier of 8 GPUs publishes: two models, moderately busy, now and then a
    GPU down."""
    source = f"local/{region}/{zone}/{rng.randrange(1 << 16)}-{rng.getrandbits(24):06x}"

    def build(sequence: int) -> capacity_pb2.CapacitySummary:
        models = []
        for model, gpus in ZONE_MODELS:
            healthy = gpus - (rng.random() < 0.03)
            slots = healthy * SLOTS_PER_GPU
            free = rng.randint(0, slots)
            queued = 0 if free else rng.randint(1, 40)
            models.append(
                capacity_pb2.ModelCapacity(
                    model=model,
                    healthy_gpus=healthy,
                    total_gpus=gpus,
                    total_slots=slots,
                    free_slots=free,
                    queued_requests=queued,
                    estimated_wait_s=queued * rng.uniform(0.05, 0.2),
                    token_throughput_capacity=healthy * rng.uniform(1800.0, 4200.0),
                    utilisation=(slots - free) / slots,
                    kv_cache_usage=rng.uniform(0.1, 0.9),
                )
            )
        return capacity_pb2.CapacitySummary(
            source_id=source,
            sequence=sequence,
            timestamp_ms=int(time.time() * 1000),
            region=region,
            zone=zone,
            publisher_healthy=True,
            models=models,
        )

    return build


class RegionalTier:
    """The Redis half of a regional tier: follows its zones, publishes their aggregate."""

    def __init__(
        self, url: str, region: str, zones: Sequence[str], cadence_s: float, maxlen: int
    ) -> None:
        self.region = region
        self.source = f"regional/{region}/bench"
        self.latest: dict[str, capacity_pb2.CapacitySummary] = {}
        self.delivered = 0
        self.reader = CapacityReader(url, {zone_stream(region, z): z for z in zones}, self.take)
        self.publisher = CapacityPublisher(
            url, region_stream(region), self.build, cadence_s=cadence_s, maxlen=maxlen
        )

    def take(self, zone: str, summary: capacity_pb2.CapacitySummary) -> None:
        self.latest[zone] = summary
        self.delivered += 1

    def build(self, sequence: int) -> capacity_pb2.CapacitySummary:
        return aggregate(
            self.latest.values(), source_id=self.source, sequence=sequence, region=self.region
        )


@dataclass
class RedisCost:
    gpus: int
    zones: int
    regions: int
    streams: int
    cadence_s: float
    maxlen: int
    duration_s: float
    redis_version: str
    zone_summary_bytes: float
    region_summary_bytes: float
    commands_per_s: float
    per_command_per_s: dict[str, float]
    usec_per_call: dict[str, float]
    redis_cpu_share_of_one_core: float
    net_in_bytes_per_s: float
    net_out_bytes_per_s: float
    memory_at_maxlen_bytes: int
    memory_zone_stream_bytes: int
    memory_region_stream_bytes: int
    xlen_zone_stream: int
    memory_growth_live_bytes: int
    regional_deliveries_per_s: float
    global_deliveries_per_s: float


async def _snapshot(admin: aioredis.Redis) -> dict[str, Any]:
    snap: dict[str, Any] = {"t": time.monotonic()}
    for section in ("commandstats", "stats", "memory", "cpu", "server"):
        snap[section] = await admin.info(section)
    return snap


async def _prefill(
    admin: aioredis.Redis, builders: dict[str, Callable[[int], Any]], maxlen: int
) -> None:
    """Fill every stream to MAXLEN with real summaries, as after ~maxlen cadences."""
    for stream, build in builders.items():
        variants = [build(s).SerializeToString() for s in range(1, 11)]
        pipe = admin.pipeline(transaction=False)
        for k in range(maxlen):
            pipe.xadd(stream, {SUMMARY_FIELD: variants[k % 10]}, maxlen=maxlen, approximate=True)
        await pipe.execute()


async def redis_cost(duration_s: float, rng: random.Random) -> RedisCost:
    """125 zones x 8 GPUs in 16 regions against a fresh Redis, at the default cadence."""
    cadence, maxlen = 0.5, 1000  # Topology defaults: summary_cadence_s, summary_stream_maxlen
    layout = [
        (f"region-{r:02d}", [f"region-{r:02d}-zone-{z}" for z in range(8 if r < 13 else 7)])
        for r in range(16)
    ]
    server = EmbeddedRedis()
    zone_builders = {zone_stream(r, z): zone_builder(r, z, rng) for r, zs in layout for z in zs}
    regionals = [RegionalTier(server.url, r, zs, cadence, maxlen) for r, zs in layout]
    for regional, (_, zones) in zip(regionals, layout, strict=True):
        for zone in zones:  # a first view, so the prefilled region summaries are realistic
            regional.take(zone, zone_builders[zone_stream(regional.region, zone)](1))
    region_builders = {region_stream(t.region): t.build for t in regionals}
    global_seen = [0]
    readers = [
        CapacityReader(
            server.url,
            {region_stream(r): r for r, _ in layout},
            lambda _name, _summary: global_seen.__setitem__(0, global_seen[0] + 1),
        ),
        *(t.reader for t in regionals),
    ]
    publishers = [
        CapacityPublisher(server.url, s, b, cadence_s=cadence, maxlen=maxlen)
        for s, b in zone_builders.items()
    ] + [t.publisher for t in regionals]
    zone_bytes = statistics.fmean(len(b(1).SerializeToString()) for b in zone_builders.values())
    region_bytes = statistics.fmean(len(b(1).SerializeToString()) for b in region_builders.values())
    admin = aioredis.Redis.from_url(server.url)
    try:
        server.start()
        empty = (await admin.info("memory"))["used_memory"]
        await _prefill(admin, {**zone_builders, **region_builders}, maxlen)
        full = (await admin.info("memory"))["used_memory"]
        first_zone, first_region = next(iter(zone_builders)), next(iter(region_builders))
        zone_mem = await admin.memory_usage(first_zone, samples=0)
        region_mem = await admin.memory_usage(first_region, samples=0)
        xlen = await admin.xlen(first_zone)
        for regional in regionals:
            regional.delivered = 0
        for reader in readers:
            reader.start()
        for publisher in publishers:  # spread over one cadence, as independent processes are
            publisher.start()
            await asyncio.sleep(cadence / len(publishers))
        await asyncio.sleep(1.0)
        before = await _snapshot(admin)
        delivered0 = sum(t.delivered for t in regionals), global_seen[0]
        await asyncio.sleep(duration_s)
        after = await _snapshot(admin)
        delivered1 = sum(t.delivered for t in regionals), global_seen[0]
    finally:
        for publisher in publishers:
            await publisher.stop()
        for reader in readers:
            await reader.stop()
        await admin.aclose()
        server.close()

    wall = after["t"] - before["t"]

    def calls(snap: dict[str, Any], name: str) -> int:
        return int(snap["commandstats"].get(f"cmdstat_{name}", {}).get("calls", 0))

    names = sorted({k.removeprefix("cmdstat_") for k in after["commandstats"]} - {"info"})
    per_command = {n: (calls(after, n) - calls(before, n)) / wall for n in names}
    per_command = {n: v for n, v in per_command.items() if v > 0}
    usec = {n: float(after["commandstats"][f"cmdstat_{n}"]["usec_per_call"]) for n in per_command}
    total = after["stats"]["total_commands_processed"] - before["stats"]["total_commands_processed"]
    total -= calls(after, "info") - calls(before, "info")
    cpu = sum(after["cpu"][k] - before["cpu"][k] for k in ("used_cpu_user", "used_cpu_sys"))
    return RedisCost(
        gpus=sum(len(zs) for _, zs in layout) * 8,
        zones=len(zone_builders),
        regions=len(layout),
        streams=len(zone_builders) + len(region_builders),
        cadence_s=cadence,
        maxlen=maxlen,
        duration_s=wall,
        redis_version=str(after["server"]["redis_version"]),
        zone_summary_bytes=zone_bytes,
        region_summary_bytes=region_bytes,
        commands_per_s=total / wall,
        per_command_per_s=per_command,
        usec_per_call=usec,
        redis_cpu_share_of_one_core=cpu / wall,
        net_in_bytes_per_s=(
            after["stats"]["total_net_input_bytes"] - before["stats"]["total_net_input_bytes"]
        )
        / wall,
        net_out_bytes_per_s=(
            after["stats"]["total_net_output_bytes"] - before["stats"]["total_net_output_bytes"]
        )
        / wall,
        memory_at_maxlen_bytes=full - empty,
        memory_zone_stream_bytes=int(zone_mem or 0),
        memory_region_stream_bytes=int(region_mem or 0),
        xlen_zone_stream=int(xlen),
        memory_growth_live_bytes=after["memory"]["used_memory"] - before["memory"]["used_memory"],
        regional_deliveries_per_s=(delivered1[0] - delivered0[0]) / wall,
        global_deliveries_per_s=(delivered1[1] - delivered0[1]) / wall,
    )


# ---------------------------------------------------------------------- 3 + 4. failover


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


def buckets(
    calls: Sequence[Call], t0: float, t1: float, width: float, region: str
) -> list[tuple[float, int, float | None, float | None]]:
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
    move_buckets_100ms: list[tuple[float, int, float | None, float | None]]
    down_latency_p50_s: float | None
    down_latency_p99_s: float | None
    regional_start_s: float
    first_eu_completion_after_ready_s: float | None
    return_buckets_250ms: list[tuple[float, int, float | None, float | None]]
    return_50_s: float | None
    return_90_s: float | None
    failed_after_ready: int


def failover(
    fleet: Fleet, *, clients: int, max_tokens: int, warm_s: float, down_s: float, back_s: float
) -> Failover:
    """Kill the eu-west regional tier under Dublin load, start it again, watch traffic move."""
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
    calls = sorted(load.calls, key=lambda c: c.end)
    failed = [c for c in calls if c.code != "OK"]
    pre = [c for c in calls if killed - (warm_s - 1.0) <= c.end < killed and c.code == "OK"]
    eu = [c for c in pre if c.route.startswith(REGION + "/")]
    original = len(eu) / len(pre) if pre else 0.0
    to_us = [
        c for c in calls if c.code == "OK" and c.route.startswith("us-east/") and c.end >= killed
    ]
    move = buckets(calls, killed, spawned, 0.1, "us-east")
    move_95 = None
    for k in range(len(move)):
        if all(share is None or share >= 0.95 for _, _, share, _ in move[k:]):
            move_95 = move[k][0]
            break
    back = buckets(calls, ready, ready + back_s, 0.25, REGION)

    def reach(fraction: float) -> float | None:
        return next((t for t, _, s, _ in back if s is not None and s >= fraction * original), None)

    first_eu = next(
        (
            c.end - ready
            for c in calls
            if c.code == "OK" and c.end >= ready and c.route.startswith(REGION + "/")
        ),
        None,
    )
    down_lat = [
        c.end - c.start for c in calls if c.code == "OK" and killed + 1.0 <= c.start < spawned
    ]
    pre_lat = [c.end - c.start for c in pre]
    codes: dict[str, int] = {}
    for c in failed:
        codes[c.code] = codes.get(c.code, 0) + 1
    samples = sorted({f"{c.code}: {c.detail}"[:300] for c in failed})[:5]
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
        first_us_east_completion_s=to_us[0].end - killed if to_us else None,
        first_us_east_started_s=to_us[0].start - killed if to_us else None,
        move_95_s=move_95,
        move_buckets_100ms=move,
        down_latency_p50_s=pct(down_lat, 0.5),
        down_latency_p99_s=pct(down_lat, 0.99),
        regional_start_s=ready - spawned,
        first_eu_completion_after_ready_s=first_eu,
        return_buckets_250ms=back,
        return_50_s=reach(0.5),
        return_90_s=reach(0.9),
        failed_after_ready=sum(1 for c in failed if c.start >= ready),
    )


# ---------------------------------------------------------------------- report


def _stats(values: Sequence[float]) -> str:
    if not values:
        return "— | — | —"
    return f"{ms(statistics.median(values))} | {ms(pct(values, 0.99))} | {ms(max(values))}"


def _series(rows: Sequence[tuple[float, int, float | None, float | None]]) -> str:
    return " ".join("·" if s is None else f"{s * 100:.0f}" for _, _, s, _ in rows)


def markdown(
    info: dict[str, Any], prop: Propagation, cost: RedisCost, fo: Failover, cadence_s: float
) -> str:
    both = prop.down_region_s + prop.up_region_s
    per_k = 1000 / cost.gpus
    lines = [
        "# Capacity flow and region failover",
        "",
        f"{info['date']} · {info['cpu']} · nproc {info['nproc']} · "
        f"{info['implementation']} {info['python']} · {info['platform']} · "
        f"Redis {cost.redis_version} · commit {info['commit']}"
        f"{' + uncommitted changes' if info['dirty'] else ''} · load average (1 min) "
        f"{info['loadavg_1m_start']:.2f} at start, {info['loadavg_1m_end']:.2f} at the end",
        "",
        "## 1. Propagation of a GPU-state change to the top of the hierarchy",
        "",
        "Fleet: us-east + eu-west, 1 zone × 2 GPUs each, summary cadence "
        f"{cadence_s * 1000:.0f} ms, "
        f"health interval {cadence_s * 1000:.0f} ms. {prop.cycles} cycles: SIGKILL "
        f"`worker-{ZONE}` (both GPUs) → first entry of the stream with healthy_gpus = 0; start it "
        "again → first entry with healthy_gpus = 2, timed from the moment both GPUs answer "
        "ServerReady (10 ms poll). Read here with XREAD BLOCK; **this measures up to the region "
        "stream** — the global tier's own reader adds one XREAD round trip (≪ 1 ms on loopback).",
        "",
        "| change | n | stream | median | P99 | max |",
        "|---|---:|---|---:|---:|---:|",
        f"| GPUs die | {len(prop.down_zone_s)} | zone | {_stats(prop.down_zone_s)} |",
        f"| GPUs die | {len(prop.down_region_s)} | region | {_stats(prop.down_region_s)} |",
        f"| GPUs come back | {len(prop.up_zone_s)} | zone | {_stats(prop.up_zone_s)} |",
        f"| GPUs come back | {len(prop.up_region_s)} | region | {_stats(prop.up_region_s)} |",
        f"| **both** | {len(both)} | **region** | {_stats(both)} |",
        "",
        f"Changes not seen within the wait: {prop.missed}. Goal: ≤ 1 s P99 at the 500 ms cadence. "
        "P99 is nearest-rank: with this few samples it is the maximum. "
        f"Worker restart to ready: median {ms(statistics.median(prop.worker_start_s))}.",
        "",
        "## 2. Redis cost per 1000 GPUs",
        "",
        f"In-process against a fresh embedded Redis: {cost.zones} zone publishers × 8 GPUs "
        f"(= {cost.gpus} GPUs, two models per zone), {cost.regions} regional tiers (a "
        "CapacityReader over their ~8 zone streams + a region publisher each) and one global "
        f"reader over the {cost.regions} region streams; cadence {cost.cadence_s * 1000:.0f} ms, "
        f"`XADD … MAXLEN ~ {cost.maxlen}`, every stream pre-filled to MAXLEN first (the steady "
        f"state after {cost.maxlen} cadences), then measured for {cost.duration_s:.1f} s.",
        "",
        "| figure | per 1000 GPUs | per stream |",
        "|---|---:|---:|",
        f"| Redis commands/s | {cost.commands_per_s * per_k:.0f} | "
        f"{cost.commands_per_s / cost.streams:.2f} |",
    ]
    for name, rate in sorted(cost.per_command_per_s.items(), key=lambda kv: -kv[1]):
        lines.append(
            f"| · {name.upper()}/s ({cost.usec_per_call[name]:.1f} µs/call) | {rate * per_k:.1f} | "
            f"{rate / cost.streams:.2f} |"
        )
    lines += [
        f"| Redis CPU (share of one core) | "
        f"{cost.redis_cpu_share_of_one_core * per_k * 100:.1f} % | — |",
        f"| network in / out | {cost.net_in_bytes_per_s * per_k / 1024:.0f} / "
        f"{cost.net_out_bytes_per_s * per_k / 1024:.0f} KiB/s | — |",
        f"| memory held at MAXLEN (used_memory delta) | "
        f"{cost.memory_at_maxlen_bytes * per_k / 2**20:.1f} MiB | "
        f"{cost.memory_at_maxlen_bytes / cost.streams / 1024:.0f} KiB |",
        f"| memory growth during the live run | "
        f"{cost.memory_growth_live_bytes * per_k / 1024:.0f} KiB | — |",
        "",
        f"One zone stream: {cost.xlen_zone_stream} entries, "
        f"{cost.memory_zone_stream_bytes / 1024:.0f} KiB (MEMORY USAGE); one region stream "
        f"{cost.memory_region_stream_bytes / 1024:.0f} KiB. A summary is "
        f"{cost.zone_summary_bytes:.0f} B (zone) / {cost.region_summary_bytes:.0f} B (region) "
        f"serialized. Summaries delivered: {cost.regional_deliveries_per_s:.0f}/s to the regional "
        f"readers, {cost.global_deliveries_per_s:.0f}/s to the global reader.",
        "",
        "## 3. Moving traffic when a region dies",
        "",
        f"{fo.clients} closed-loop unary clients from Dublin (`x-meridian-client-geo: {DUBLIN}`, "
        f"max_tokens {fo.max_tokens}) against the global endpoint (plaintext; tier to tier "
        f"{'mutual TLS' if fo.inner_tls else 'plaintext'}, auth off), time_scale {fo.time_scale}; "
        f"`regional-{REGION}` SIGKILLed mid-run (Fleet.kill).",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| requests (all phases) | {fo.requests} |",
        f"| before the kill: eu-west share, rate, latency P50 / P99 | "
        f"{fo.original_eu_share * 100:.0f} %, {fo.pre_kill_rps:.0f} req/s, "
        f"{ms(fo.pre_kill_latency_p50_s)} / {ms(fo.pre_kill_latency_p99_s)} |",
        f"| kill → first completion in us-east (that request started at) | "
        f"{ms(fo.first_us_east_completion_s)} ({ms(fo.first_us_east_started_s)}) |",
        "| kill → ≥ 95 % of completions in us-east (100 ms buckets, for good) | "
        f"{ms(fo.move_95_s)} |",
        f"| latency P50 / P99 while eu-west is down | "
        f"{ms(fo.down_latency_p50_s)} / {ms(fo.down_latency_p99_s)} |",
        f"| requests in flight at the kill | {fo.in_flight_at_kill} |",
        f"| failed requests, total | {fo.failed} {fo.failure_codes or ''} |",
        f"| · of them in flight at the kill | {fo.failed_in_flight_at_kill} |",
        f"| · of them started after the kill (goal 0) | {fo.failed_started_after_kill} |",
        "",
        "us-east share per 100 ms after the kill (%): " + _series(fo.move_buckets_100ms[:20]),
        "",
    ]
    if fo.failure_samples:
        lines += ["Failures seen:", ""] + [f"- `{s}`" for s in fo.failure_samples] + [""]
    lines += [
        "## 4. Return after the region comes back",
        "",
        f"`regional-{REGION}` started again (ready after {ms(fo.regional_start_s)}); eu-west share "
        f"of completions per 250 ms bucket from the moment it answers ServerReady "
        f"(original share {fo.original_eu_share * 100:.0f} %).",
        "",
        f"- first eu-west completion after ready: {ms(fo.first_eu_completion_after_ready_s)}",
        f"- 50 % of the original share reached at: {ms(fo.return_50_s)}; "
        f"90 %: {ms(fo.return_90_s)}",
        f"- failed requests started after ready: {fo.failed_after_ready}",
        "",
        "| t after ready | completions | eu-west share | median latency |",
        "|---:|---:|---:|---:|",
    ]
    for t, n, share, p50 in fo.return_buckets_250ms:
        cell = "—" if share is None else f"{share * 100:.0f} %"
        lines.append(f"| {t:.2f} s | {n} | {cell} | {ms(p50)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cycles", type=int, default=15, help="kill/restart cycles for (1)")
    parser.add_argument("--redis-s", type=float, default=10.0, help="measured seconds for (2)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--down-s", type=float, default=4.0, help="region down for (3)")
    parser.add_argument("--back-s", type=float, default=12.0, help="watched after return (4)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-logs", action="store_true", help="keep the fleet's run dir")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    began = time.monotonic()
    load_start = os.getloadavg()[0]  # other work on the machine skews every figure here

    print("(2) Redis cost: 1000 GPUs in 125 zones / 16 regions ...", flush=True)
    cost = asyncio.run(redis_cost(args.redis_s, rng))
    print(
        f"    {cost.commands_per_s:.0f} commands/s, Redis CPU "
        f"{cost.redis_cpu_share_of_one_core * 100:.1f} %, "
        f"{cost.memory_at_maxlen_bytes / 2**20:.1f} MiB at MAXLEN",
        flush=True,
    )

    run_dir = tempfile.mkdtemp(prefix="meridian-capacity-flow-")
    fleet: Fleet | None = None
    try:
        spec_path = Path(run_dir) / "fleet.yaml"
        spec_path.write_text(yaml.safe_dump(fleet_spec(args.time_scale)))
        fleet = Fleet(spec_path, Path(run_dir) / "run")
        cadence_s = fleet.topology.summary_cadence_s
        print(f"starting the fleet (logs in {run_dir}/run) ...", flush=True)
        fleet.start(timeout_s=90)
        # (3)+(4) first, on a settled fleet: the kills of (1) take eu-west down and
        # start the global tier's fail-back ramp, which would skew the "before" share.
        print("(3)+(4) killing and restarting regional-eu-west under load ...", flush=True)
        fo = failover(
            fleet,
            clients=args.clients,
            max_tokens=args.max_tokens,
            warm_s=3.0,
            down_s=args.down_s,
            back_s=args.back_s,
        )
        print(
            f"    moved in {ms(fo.move_95_s)}, {fo.failed} failed "
            f"({fo.failed_started_after_kill} started after the kill)",
            flush=True,
        )
        print(f"(1) propagation: {args.cycles} kill/restart cycles of worker-{ZONE}", flush=True)
        prop = propagation(fleet, args.cycles, rng)
    finally:
        if fleet is not None:
            fleet.stop()
        if not args.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)

    info = {
        **machine(),
        **revision(),
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0],
    }
    table = markdown(info, prop, cost, fo, cadence_s)
    print()
    print(table)
    print(f"(whole run: {time.monotonic() - began:.0f} s)")
    if args.no_write:
        return
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "benchmark": "capacity_flow",
        "machine": info,
        "propagation": {
            **asdict(prop),
            "note": "measured up to the region stream; the global tier's XREAD adds one round trip",
            "region_median_s": statistics.median(prop.down_region_s + prop.up_region_s),
            "region_p99_s": pct(prop.down_region_s + prop.up_region_s, 0.99),
        },
        "redis_cost": asdict(cost),
        "failover": asdict(fo),
    }
    (RESULTS / "capacity_flow.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / "capacity_flow.md").write_text(table)
    print(f"wrote {RESULTS / 'capacity_flow.json'} and {RESULTS / 'capacity_flow.md'}")


if __name__ == "__main__":
    main()
