"""Measurement (1) of capacity_flow: how fast a GPU-state change reaches the region stream.

A zone's worker process (both its GPUs) is killed, then started again, ``--cycles`` times;
the delay from the change to the first ``meridian:capacity:region:{regions}:<region>`` entry whose
``healthy_gpus`` shows it, read with XREAD BLOCK from here (the global tier's reader adds
one XREAD round trip on top). The zone stream is watched too, to split the delay into
"local tier noticed and published" and "regional tier republished".

Process control stays on the caller's (main) thread: children get PR_SET_PDEATHSIG from
the thread that started them. Only the stream watcher runs in a thread of its own.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from bench.capacity_fleet import MODEL, REGION, ZONE, ms, restart_precisely
from cli.launcher import Fleet
from common.capacity.streams import SUMMARY_FIELD, region_stream, zone_stream
from common.gen.meridian.v1 import capacity_pb2


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
