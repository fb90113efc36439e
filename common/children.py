"""A tier's view of its children: channels, direct health evidence, load, summaries.

Every tier routes over a ``ChildSet``. It owns one gRPC channel per child,
probes each child's ServerReady on an interval, and takes capacity summaries
from the Redis reader. Pickers read ``Child`` state; only this module and the
proxy core write it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from common.config import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import capacity_pb2
from common.geo import GeoPoint
from common.grpc_server import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(eq=False)
class Child:
    """One child endpoint (a region, a zone or a GPU) and what this tier knows of it."""

    name: str
    endpoint: Endpoint
    models: frozenset[str]
    location: GeoPoint | None = None
    speed: float = 1.0
    # Direct evidence: the last probe or forward succeeded.
    healthy: bool = True
    healthy_since: float = 0.0
    last_error: str = ""
    # Load this tier put on the child and has not seen finish.
    outstanding_requests: int = 0
    outstanding_work: float = 0.0
    # Newest capacity summary and when it arrived (this tier's monotonic clock).
    summary: capacity_pb2.CapacitySummary | None = None
    summary_received_at: float = 0.0
    stub: pb_grpc.GRPCInferenceServiceStub | None = field(default=None, repr=False)

    def fresh_summary(self, now: float, ttl_s: float) -> capacity_pb2.CapacitySummary | None:
        """The summary if younger than ``ttl_s``; a stale one reads as unknown (None)."""
        if self.summary is None or now - self.summary_received_at > ttl_s:
            return None
        return self.summary

    def model_capacity(
        self, model: str, now: float, ttl_s: float
    ) -> capacity_pb2.ModelCapacity | None:
        """The fresh summary's entry for ``model``; None when unknown."""
        summary = self.fresh_summary(now, ttl_s)
        if summary is None:
            return None
        for entry in summary.models:
            if entry.model == model:
                return entry
        return None

    def may_serve(self, model: str, now: float, ttl_s: float) -> bool:
        """Healthy by direct evidence, serves ``model``, and no fresh summary says it has
        no healthy GPU for it (a stale summary, or unknown parts, prove nothing)."""
        if not self.healthy or model not in self.models:
            return False
        entry = self.model_capacity(model, now, ttl_s)
        return entry is None or entry.healthy_gpus > 0 or entry.unknown_children > 0


class ChildSet:
    """The children of one tier, with channels and a health-probe loop."""

    def __init__(
        self,
        children: Iterable[Child],
        *,
        probe_interval_s: float,
        summary_ttl_s: float,
        kind: str = "child",
        probe: bool = True,
        clock: Clock = time.monotonic,
    ) -> None:
        self.children = tuple(children)
        self.kind = kind
        # False when another component (the local tier's BackendMonitor) checks health.
        self.probe = probe
        self.by_name = {c.name: c for c in self.children}
        self.probe_interval_s = probe_interval_s
        self.summary_ttl_s = summary_ttl_s
        self.clock = clock
        # Called on every health transition (publishers publish at once, the local
        # tier re-derives its free pools).
        self._listeners: list[Callable[[], None]] = []
        self._channels: list[grpc.aio.Channel] = []
        self._probe_task: asyncio.Task[None] | None = None

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def __iter__(self) -> Iterator[Child]:
        return iter(self.children)

    async def start(self) -> None:
        for child in self.children:
            channel = grpc.aio.insecure_channel(child.endpoint.address, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            child.stub = pb_grpc.GRPCInferenceServiceStub(channel)
        if self.probe:
            await self.probe_all()
            self._probe_task = asyncio.create_task(self._probe_loop(), name="child-probes")

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        for channel in self._channels:
            await channel.close()

    def mark_failed(self, child: Child, error: str) -> None:
        """A forward to ``child`` failed: stop routing to it until a probe succeeds."""
        if child.healthy:
            log.warning("child %s marked down: %s", child.name, error)
            child.healthy = False
            self._changed()
        child.last_error = error

    def mark_healthy(self, child: Child) -> None:
        if not child.healthy:
            log.info("child %s is back", child.name)
            child.healthy = True
            child.healthy_since = self.clock()
            child.last_error = ""
            self._changed()

    def take_summary(self, child_name: str, summary: capacity_pb2.CapacitySummary) -> None:
        """Record a summary from the Redis reader; older sequences from a source are ignored."""
        child = self.by_name.get(child_name)
        if child is None:
            return
        old = child.summary
        if (
            old is not None
            and old.source_id == summary.source_id
            and (summary.sequence <= old.sequence)
        ):
            return
        child.summary = summary
        child.summary_received_at = self.clock()

    def nothing_healthy(self, model: str, tried: Collection[str] = ()) -> str:
        """Why no child can take a request for ``model``: each child and its state."""
        states = []
        for c in self.children:
            if model not in c.models:
                continue
            why = "already tried" if c.name in tried else c.last_error or "no capacity"
            states.append(f"{c.name} ({why})")
        return f"no healthy {self.kind} can serve model {model!r}: " + "; ".join(states)

    def any_healthy(self) -> bool:
        return any(c.healthy for c in self.children)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(c) for c in self.children))

    async def _probe(self, child: Child) -> None:
        assert child.stub is not None
        try:
            reply = await child.stub.ServerReady(
                pb.ServerReadyRequest(), timeout=max(0.2, self.probe_interval_s)
            )
        except grpc.aio.AioRpcError as exc:
            self.mark_failed(child, f"probe: {exc.code().name}: {exc.details()}")
            return
        if reply.ready:
            self.mark_healthy(child)
        else:
            self.mark_failed(child, "probe: ServerReady says not ready")

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not stop probing
                log.exception("health probe round failed")
