"""A 1024-GPU fleet's ops surface, in this process: the state the dashboard reads at scale.

Starting 1024 emulated GPU servers and 23 tiers would take minutes; what the
dashboard reads is each tier's ops HTTP. So every regional and local tier of a
generated topology (``sim.fleet_gen``) gets a real ``OpsServer`` over a real
``ChildSet`` — GPUs as the local tier keeps them (``GpuChild``, ``LocalView`` with
the GPUs' own load reports, ``local_lb.server.gpu_details``), zones and regions
with real capacity summaries taken at known ages — and the global gets its
``OpsServer`` with the real ``FleetView``. Each GPU's state and load follow from its
index (``GpuPlan``), so a test can say what the page must show without asking the
code under test; one zone's local tier is never started (unreachable, its GPUs unknown).
"""

from __future__ import annotations

import copy
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from common.capacity.summary import aggregate
from common.config.node import Endpoint
from common.config.topology import Topology, topology_from_mapping
from common.gen.meridian.v1 import capacity_pb2
from common.observability.tier_metrics import TierMetrics
from common.operations.fleet_view import FleetView
from common.operations.ops_http import OpsServer
from common.request.children import Child, ChildSet
from local_lb.load_book import LoadSample
from local_lb.server import gpu_details
from local_lb.state import GpuChild, LocalView
from sim.fleet_gen import fleet_mapping

GPUS = 1024
REGIONS = 6
MODEL = "sim-llm"
QUEUE_PRIORITIES = ("critical", "standard", "sheddable")


@dataclass(frozen=True)
class GpuPlan:
    """One GPU's state, from its index in the fleet."""

    name: str
    hardware: str
    slots: int
    state: str  # ok, down, ejected, drained; unknown when its zone's tier is not there
    outstanding: int
    waiting: int

    @classmethod
    def of(cls, index: int, name: str, hardware: str, slots: int, reachable: bool) -> GpuPlan:
        state = "ok"
        if not reachable:
            state = "unknown"
        elif index % 97 == 5:
            state = "down"
        elif index % 89 == 7:
            state = "ejected"
        elif index % 83 == 11:
            state = "drained"
        busy = state not in ("down", "unknown")
        outstanding = (index * 7) % (slots + 1) if busy else 0
        waiting = index % 3 if busy else 0
        return cls(name, hardware, slots, state, outstanding, waiting)


@dataclass(frozen=True)
class ZonePlan:
    name: str
    region: str
    gpus: tuple[GpuPlan, ...]
    reachable: bool
    summary_age_s: float  # of its summary as its regional tier holds it
    queue: dict[str, int] = field(default_factory=dict)  # its local tier's queue


@dataclass(frozen=True)
class RegionPlan:
    name: str
    zones: tuple[ZonePlan, ...]
    summary_age_s: float  # of its summary as the global tier holds it


class Clock:
    """A tier's clock, moved by hand so summary ages are exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plan(mapping: dict[str, Any], unreachable_zone: str) -> tuple[RegionPlan, ...]:
    """What every GPU, zone and region is doing, from the generated ``mapping``."""
    index = 0
    regions = []
    for r, region in enumerate(mapping["regions"]):
        zones = []
        for z, zone in enumerate(region["zones"]):
            reachable = zone["name"] != unreachable_zone
            gpus = []
            for gpu in zone["gpus"]:
                slots = gpu["max_concurrency"]
                gpus.append(GpuPlan.of(index, gpu["name"], gpu["hardware"], slots, reachable))
                index += 1
            queue = {"critical": z, "standard": 2 * r + 1, "sheddable": 0}
            age = round(0.2 + 0.1 * (3 * r + z), 1)
            zones.append(ZonePlan(zone["name"], region["name"], tuple(gpus), reachable, age, queue))
        regions.append(RegionPlan(region["name"], tuple(zones), round(0.3 + 0.2 * r, 1)))
    return tuple(regions)


def zone_summary(zone: ZonePlan) -> capacity_pb2.CapacitySummary:
    """The capacity summary a zone's local tier would publish for ``zone``."""
    serving = [g for g in zone.gpus if g.state == "ok"]
    slots = sum(g.slots for g in serving)
    busy = sum(g.outstanding for g in serving)
    entry = capacity_pb2.ModelCapacity(
        model=MODEL,
        healthy_gpus=len(serving),
        total_gpus=len(zone.gpus),
        total_slots=slots,
        free_slots=max(0, slots - busy),
        busy_slots=busy,
        queued_requests=sum(g.waiting for g in serving) + sum(zone.queue.values()),
        utilisation=busy / slots if slots else 0.0,
    )
    return capacity_pb2.CapacitySummary(
        source_id=f"local/{zone.region}/{zone.name}/0",
        sequence=1,
        region=zone.region,
        zone=zone.name,
        publisher_healthy=True,
        models=[entry],
    )


def summarised(names_ages: list[tuple[str, float, capacity_pb2.CapacitySummary]]) -> ChildSet:
    """A tier's children (zones or regions) holding ``summary`` taken ``age`` ago."""
    clock = Clock()
    children = ChildSet(
        [Child(name, Endpoint("127.0.0.1", 1), frozenset({MODEL})) for name, _, _ in names_ages],
        probe_interval_s=1,
        summary_ttl_s=3600,
        probe=False,
        clock=clock,
    )
    start = clock.now
    for name, age, summary in names_ages:
        clock.now = start - age
        children.take_summary(name, summary)
    clock.now = start
    return children


def local_ops(zone: ZonePlan) -> OpsServer:
    """The ops HTTP of ``zone``'s local tier, over its GPUs as planned."""
    gpus = []
    for g in zone.gpus:
        child = GpuChild(
            g.name, Endpoint("127.0.0.1", 1), frozenset({MODEL}), hardware=g.hardware, slots=g.slots
        )
        child.healthy = g.state != "down"
        child.last_error = "connection refused" if g.state == "down" else ""
        child.ejected = g.state == "ejected"
        child.drained = g.state == "drained"
        child.outstanding_requests = g.outstanding
        gpus.append(child)
    view = LocalView(tuple(gpus), report_max_age_s=3600)
    now = time.monotonic()
    for g in zone.gpus:
        if g.state != "down":
            view.load.update(g.name, LoadSample(g.outstanding, g.waiting, 0.5, now, "metrics"))
    children = ChildSet(gpus, probe_interval_s=1, summary_ttl_s=1, kind="GPU", probe=False)
    return OpsServer(
        Endpoint("127.0.0.1", 0),
        zone.name,
        TierMetrics("local", children),
        child_details=lambda gpu: gpu_details(view, gpu),
        extra_state=lambda: {"queue": dict(zone.queue)},
    )


def regional_ops(region: RegionPlan) -> OpsServer:
    zones = summarised([(z.name, z.summary_age_s, zone_summary(z)) for z in region.zones])
    for zone in region.zones:
        if not zone.reachable:  # its tier is gone: the regional's probes have said so
            zones.mark_failed(zones.by_name[zone.name], "connection refused")
    return OpsServer(Endpoint("127.0.0.1", 0), region.name, TierMetrics("regional", zones))


def region_summary(region: RegionPlan) -> capacity_pb2.CapacitySummary:
    return aggregate(
        [zone_summary(z) for z in region.zones],
        source_id=f"regional/{region.name}/0",
        sequence=1,
        region=region.name,
    )


def free_port() -> int:
    """A loopback port nothing listens on (the unreachable zone's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@dataclass
class BigFleet:
    """The running ops surface: the global's address, its topology and the plan."""

    topology: Topology
    regions: tuple[RegionPlan, ...]
    ops: OpsServer

    @property
    def address(self) -> str:
        return self.ops.address

    def zones(self) -> list[ZonePlan]:
        return [z for r in self.regions for z in r.zones]


@asynccontextmanager
async def big_fleet(seed: int = 15) -> AsyncIterator[BigFleet]:
    """Every tier's ops HTTP for a generated ``GPUS``-GPU fleet, stopped at the end."""
    mapping = copy.deepcopy(fleet_mapping(gpus=GPUS, regions=REGIONS, seed=seed))
    unreachable = mapping["regions"][-1]["zones"][-1]["name"]
    regions = plan(mapping, unreachable)
    started: list[OpsServer] = []
    try:
        for region, entry in zip(regions, mapping["regions"], strict=True):
            server = regional_ops(region)
            await server.start()
            started.append(server)
            entry["ops_listen"] = server.address
            for zone, zone_entry in zip(region.zones, entry["zones"], strict=True):
                if not zone.reachable:
                    zone_entry["ops_listen"] = f"127.0.0.1:{free_port()}"
                    continue
                server = local_ops(zone)
                await server.start()
                started.append(server)
                zone_entry["ops_listen"] = server.address
        topology = topology_from_mapping(mapping)
        own = summarised([(r.name, r.summary_age_s, region_summary(r)) for r in regions])
        view = FleetView(topology, timeout_s=10)
        ops = OpsServer(
            Endpoint("127.0.0.1", 0), "global", TierMetrics("global", own), extensions=(view,)
        )
        await ops.start()
        started.append(ops)
        yield BigFleet(topology, regions, ops)
    finally:
        for server in reversed(started):
            await server.stop()
