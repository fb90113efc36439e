"""The fairness bench's zone: one local tier's topology and the instruments that watch it.

``zone_topology`` builds the one-zone topology with two tenants of equal weight;
``QueueProbe`` times each tenant's waits in the central queue; ``Monitor`` samples the
GPUs' batch and engine FIFO, the queue's depth and the event loop's lag; ``settle``
waits for the tier to drain between phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter, defaultdict
from typing import Any

from common.config.topology import Topology, topology_from_mapping
from common.tier.server import TierServer
from local_lb.queue import CentralQueue
from local_lb.queue_entries import QueuedRequest
from sim.engine import PREFILL_S_PER_TOKEN
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers

MODEL = "bench-llm"
REGION, ZONE = "bench", "bench-1a"
STEADY, FLOOD, SHARED = "steady", "flood", "shared"
SAMPLE_EVERY_S = 0.02


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


async def settle(tier: TierServer, timeout_s: float = 10.0) -> None:
    """Until nothing is queued or in flight at the tier (bounded)."""
    balancer: Any = tier.balancer
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not len(balancer.queue) and balancer.view.inflight_total == 0:
            return
        await asyncio.sleep(0.05)
