"""Measurement (2) of capacity_flow: what capacity summaries cost Redis per 1000 GPUs.

In-process, on a fresh embedded Redis: 125 zone publishers (8 GPUs each, 1000 GPUs), 16
regional readers + publishers and one global reader, at the 500 ms cadence; commands/s,
network bytes, Redis CPU and the memory the streams hold at their MAXLEN.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import (
    SUMMARY_FIELD,
    CapacityPublisher,
    CapacityReader,
    region_stream,
    zone_stream,
)
from common.capacity.summary import aggregate
from common.gen.meridian.v1 import capacity_pb2

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


CADENCE_S, MAXLEN = 0.5, 1000  # Topology defaults: summary_cadence_s, summary_stream_maxlen
Layout = list[tuple[str, list[str]]]


def fleet_layout() -> Layout:
    """16 regions of 8 zones (the last three of 7): 125 zones, 1000 GPUs at 8 per zone."""
    return [
        (f"region-{r:02d}", [f"region-{r:02d}-zone-{z}" for z in range(8 if r < 13 else 7)])
        for r in range(16)
    ]


class Hierarchy:
    """Every publisher and reader of the 1000-GPU fleet, built before Redis starts."""

    def __init__(self, url: str, layout: Layout, rng: random.Random) -> None:
        self.zone_builders = {
            zone_stream(r, z): zone_builder(r, z, rng) for r, zs in layout for z in zs
        }
        self.regionals = [RegionalTier(url, r, zs, CADENCE_S, MAXLEN) for r, zs in layout]
        for regional, (_, zones) in zip(self.regionals, layout, strict=True):
            for zone in zones:  # a first view, so the prefilled region summaries are realistic
                regional.take(zone, self.zone_builders[zone_stream(regional.region, zone)](1))
        self.region_builders = {region_stream(t.region): t.build for t in self.regionals}
        self.global_seen = 0
        self.readers = [
            CapacityReader(url, {region_stream(r): r for r, _ in layout}, self._global_take),
            *(t.reader for t in self.regionals),
        ]
        self.publishers = [
            CapacityPublisher(url, s, b, cadence_s=CADENCE_S, maxlen=MAXLEN)
            for s, b in self.zone_builders.items()
        ] + [t.publisher for t in self.regionals]

    def _global_take(self, _name: str, _summary: capacity_pb2.CapacitySummary) -> None:
        self.global_seen += 1

    def delivered(self) -> tuple[int, int]:
        """Summaries delivered so far: to all regional readers, to the global reader."""
        return sum(t.delivered for t in self.regionals), self.global_seen

    async def start(self) -> None:
        for regional in self.regionals:  # the prefill's first views are not live deliveries
            regional.delivered = 0
        for reader in self.readers:
            reader.start()
        for publisher in self.publishers:  # spread over one cadence, as independent processes are
            publisher.start()
            await asyncio.sleep(CADENCE_S / len(self.publishers))

    async def stop(self) -> None:
        for publisher in self.publishers:
            await publisher.stop()
        for reader in self.readers:
            await reader.stop()


@dataclass
class Sample:
    """Redis before and after the live window, and the streams as they stood at MAXLEN."""

    empty_bytes: int
    full_bytes: int
    zone_stream_bytes: int
    region_stream_bytes: int
    zone_xlen: int
    before: dict[str, Any]
    after: dict[str, Any]
    delivered_before: tuple[int, int]
    delivered_after: tuple[int, int]


async def _measure(server: EmbeddedRedis, hierarchy: Hierarchy, duration_s: float) -> Sample:
    """Start Redis, fill it to MAXLEN, run the hierarchy live and snapshot INFO around it."""
    admin = aioredis.Redis.from_url(server.url)
    try:
        server.start()
        empty = (await admin.info("memory"))["used_memory"]
        await _prefill(admin, {**hierarchy.zone_builders, **hierarchy.region_builders}, MAXLEN)
        full = (await admin.info("memory"))["used_memory"]
        first_zone = next(iter(hierarchy.zone_builders))
        first_region = next(iter(hierarchy.region_builders))
        zone_mem = await admin.memory_usage(first_zone, samples=0)
        region_mem = await admin.memory_usage(first_region, samples=0)
        xlen = await admin.xlen(first_zone)
        await hierarchy.start()
        await asyncio.sleep(1.0)
        before = await _snapshot(admin)
        delivered_before = hierarchy.delivered()
        await asyncio.sleep(duration_s)
        after = await _snapshot(admin)
        delivered_after = hierarchy.delivered()
    finally:
        await hierarchy.stop()
        await admin.aclose()
        server.close()
    return Sample(
        empty_bytes=empty,
        full_bytes=full,
        zone_stream_bytes=int(zone_mem or 0),
        region_stream_bytes=int(region_mem or 0),
        zone_xlen=int(xlen),
        before=before,
        after=after,
        delivered_before=delivered_before,
        delivered_after=delivered_after,
    )


def _commands(
    before: dict[str, Any], after: dict[str, Any], wall: float
) -> tuple[dict[str, float], dict[str, float], int]:
    """Calls/s and µs/call by command, and all commands in the window; our own INFO
    snapshots are left out, they are the bench's load, not the hierarchy's."""

    def calls(snap: dict[str, Any], name: str) -> int:
        return int(snap["commandstats"].get(f"cmdstat_{name}", {}).get("calls", 0))

    names = sorted({k.removeprefix("cmdstat_") for k in after["commandstats"]} - {"info"})
    per_command = {n: (calls(after, n) - calls(before, n)) / wall for n in names}
    per_command = {n: v for n, v in per_command.items() if v > 0}
    usec = {n: float(after["commandstats"][f"cmdstat_{n}"]["usec_per_call"]) for n in per_command}
    total = after["stats"]["total_commands_processed"] - before["stats"]["total_commands_processed"]
    total -= calls(after, "info") - calls(before, "info")
    return per_command, usec, total


async def redis_cost(duration_s: float, rng: random.Random) -> RedisCost:
    """125 zones x 8 GPUs in 16 regions against a fresh Redis, at the default cadence."""
    layout = fleet_layout()
    server = EmbeddedRedis()
    hierarchy = Hierarchy(server.url, layout, rng)
    zone_builders, region_builders = hierarchy.zone_builders, hierarchy.region_builders
    zone_bytes = statistics.fmean(len(b(1).SerializeToString()) for b in zone_builders.values())
    region_bytes = statistics.fmean(len(b(1).SerializeToString()) for b in region_builders.values())
    sample = await _measure(server, hierarchy, duration_s)
    before, after = sample.before, sample.after
    wall = after["t"] - before["t"]
    per_command, usec, total = _commands(before, after, wall)
    cpu = sum(after["cpu"][k] - before["cpu"][k] for k in ("used_cpu_user", "used_cpu_sys"))

    def rate(section: str, key: str) -> float:
        return (after[section][key] - before[section][key]) / wall

    return RedisCost(
        gpus=sum(len(zs) for _, zs in layout) * 8,
        zones=len(zone_builders),
        regions=len(layout),
        streams=len(zone_builders) + len(region_builders),
        cadence_s=CADENCE_S,
        maxlen=MAXLEN,
        duration_s=wall,
        redis_version=str(after["server"]["redis_version"]),
        zone_summary_bytes=zone_bytes,
        region_summary_bytes=region_bytes,
        commands_per_s=total / wall,
        per_command_per_s=per_command,
        usec_per_call=usec,
        redis_cpu_share_of_one_core=cpu / wall,
        net_in_bytes_per_s=rate("stats", "total_net_input_bytes"),
        net_out_bytes_per_s=rate("stats", "total_net_output_bytes"),
        memory_at_maxlen_bytes=sample.full_bytes - sample.empty_bytes,
        memory_zone_stream_bytes=sample.zone_stream_bytes,
        memory_region_stream_bytes=sample.region_stream_bytes,
        xlen_zone_stream=sample.zone_xlen,
        memory_growth_live_bytes=after["memory"]["used_memory"] - before["memory"]["used_memory"],
        regional_deliveries_per_s=(sample.delivered_after[0] - sample.delivered_before[0]) / wall,
        global_deliveries_per_s=(sample.delivered_after[1] - sample.delivered_before[1]) / wall,
    )
