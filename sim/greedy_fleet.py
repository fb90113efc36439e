"""The oracle's book of the fleet: every GPU's true load, grouped so a dispatch is cheap.

GPUs alike in everything a completion time depends on but load and cache —
(region, hardware, effective speed, time scale, slots, KV size) — form a
group. Inside a group the least-loaded GPU is the fastest for a request that
finds nothing in the cache, so each group keeps a lazy heap keyed by
(requests on the GPU, KV reserved): its best GPU is the top. Every change of
a GPU's load pushes a fresh entry and makes the old one stale (a version
number); stale entries are dropped when they reach the top, or all at once
when the heap outgrows its members four to one. A GPU that went down, came
back or changed speed moves group when it is next looked at, or when
``sync_all`` re-reads the whole fleet.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from sim.gpu_model import SimGpu

# Heap entries past the top that may be popped looking for KV room, per group.
KV_SCAN = 8

GroupKey = tuple[str, str, float, float, int, int]


@dataclass(frozen=True)
class PlacedGpu:
    """A simulated GPU and where it stands."""

    gpu: SimGpu
    region: str
    zone: str


@dataclass(eq=False, slots=True)
class TrackedGpu:
    """One GPU as the oracle accounts for it."""

    placed: PlacedGpu
    index: int
    group: GpuGroup | None = None
    active: int = 0  # requests bound to it and not finished (running or being admitted)
    kv: int = 0  # their KV reservations
    version: int = 0

    def admits(self, reservation: int) -> bool:
        group = self.group
        return (
            group is not None
            and self.active < group.slots
            and self.kv + reservation <= group.kv_tokens
        )


@dataclass(eq=False)
class GpuGroup:
    """GPUs alike in everything but load and cache, with a lazy least-loaded heap:
    an entry is (requests, KV reserved, index, version)."""

    key: GroupKey
    region: int  # index into FleetBook.regions
    scale: float  # time_scale / speed: multiplies the engine's A100 step cost
    slots: int
    kv_tokens: int
    members: dict[int, TrackedGpu] = field(default_factory=dict)
    heap: list[tuple[int, int, int, int]] = field(default_factory=list)

    def push(self, g: TrackedGpu) -> None:
        heapq.heappush(self.heap, (g.active, g.kv, g.index, g.version))
        if len(self.heap) > 4 * len(self.members) + 16:
            self.heap = [(t.active, t.kv, t.index, t.version) for t in self.members.values()]
            heapq.heapify(self.heap)

    def matches(self, sim: SimGpu) -> bool:
        """``sim`` still belongs here: up, at this group's speed and time scale."""
        return sim.up and sim.speed == self.key[2] and sim.time_scale == self.key[3]


class FleetBook:
    """Every GPU of the fleet, its true load as the oracle bound it, and its group."""

    def __init__(self, gpus: Sequence[PlacedGpu]) -> None:
        self.regions = list(dict.fromkeys(p.region for p in gpus))
        self.gpus = [TrackedGpu(p, i) for i, p in enumerate(gpus)]
        self.groups: dict[GroupKey, GpuGroup] = {}
        self.largest_kv = max((p.gpu.cfg.kv_cache_tokens for p in gpus), default=0)
        self.sync_all()

    def sync_all(self) -> None:
        for g in self.gpus:
            self.sync(g)

    def sync(self, g: TrackedGpu) -> None:
        """Put ``g`` in the group its true state says (none while it is down)."""
        sim, cfg = g.placed.gpu, g.placed.gpu.cfg
        group = None
        if sim.up:
            key = (g.placed.region, cfg.hardware, sim.speed, sim.time_scale,
                   cfg.max_concurrency, cfg.kv_cache_tokens)  # fmt: skip
            group = self.groups.get(key)
            if group is None:
                region = self.regions.index(g.placed.region)
                scale = sim.time_scale / sim.speed
                group = GpuGroup(key, region, scale, cfg.max_concurrency, cfg.kv_cache_tokens)
                self.groups[key] = group
        if group is g.group:
            return
        if g.group is not None:
            del g.group.members[g.index]
        g.group = group
        g.version += 1
        if group is not None:
            group.members[g.index] = g
            group.push(g)

    def current(self, g: TrackedGpu) -> GpuGroup | None:
        """``g``'s group, re-derived first if its GPU changed (down, back, new speed)."""
        group = g.group
        if (group is None and g.placed.gpu.up) or (
            group is not None and not group.matches(g.placed.gpu)
        ):
            self.sync(g)
        return g.group

    def load_changed(self, g: TrackedGpu, requests: int, kv: int) -> None:
        """``g`` took (positive) or finished (negative) requests: a fresh heap entry."""
        g.active += requests
        g.kv += kv
        g.version += 1
        before = g.group
        group = self.current(g)
        if group is not None and group is before:  # a new group has its entry already
            group.push(g)

    def best_of(self, group: GpuGroup, reservation: int) -> TrackedGpu | None:
        """The group's least-loaded GPU that admits ``reservation`` now, if any. When the
        top lacks KV room, up to ``KV_SCAN`` more are looked at (fewer requests may not
        mean less KV)."""
        heap, held, found = group.heap, [], None
        gpus, speed, time_scale = self.gpus, group.key[2], group.key[3]
        while heap:
            active, kv, index, version = heap[0]
            g = gpus[index]
            sim = g.placed.gpu
            if g.group is not group or version != g.version:
                heapq.heappop(heap)  # stale
            elif not sim.up or sim.speed != speed or sim.time_scale != time_scale:
                self.sync(g)  # it went down or changed speed: its entry is stale now
            elif active >= group.slots:
                break  # the least loaded is full: all are
            elif kv + reservation <= group.kv_tokens:
                found = g
                break
            else:
                held.append(heapq.heappop(heap))
                if len(held) >= KV_SCAN:
                    break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def servable(self, reservation: int) -> bool:
        """Some GPU that is up could ever hold a KV reservation this large."""
        return any(g.members and g.kv_tokens >= reservation for g in self.groups.values())
