"""A tier's view of its children: channels, direct health evidence, load, summaries.

Every tier routes over a ``ChildSet``. It owns one gRPC channel per child, with
keepalive (a hung child's calls fail UNAVAILABLE and its Watch breaks within
``time_s + timeout_s``), follows each child's grpc.health.v1 Watch (or ServerReady
without one; re-probed while a child is down; ``common.request.health``), and
takes capacity summaries from the Redis reader. Pickers read ``Child`` state;
only this module and the proxy core write it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from common.basics.geo import GeoPoint
from common.basics.tasks import cancel_and_wait
from common.capacity.summary import combine_replicas, significant_change
from common.config.liveness import Keepalive
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import capacity_pb2
from common.request.health import HealthChecker
from common.request.server import channel_options, dial

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Capacity = capacity_pb2.ModelCapacity
Serving = tuple[bool, Capacity | None]  # may it serve a model, and the report that says so


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
    # Set by the Admin API: no new requests, in-flight ones finish, health still watched.
    drained: bool = False
    # When direct evidence last turned healthy (-inf: healthy from the start).
    healthy_since: float = float("-inf")
    last_error: str = ""
    # Load this tier put on the child and has not seen finish.
    outstanding_requests: int = 0
    outstanding_work: float = 0.0
    # outstanding_requests when the newest capacity report arrived: what was sent
    # since then is not in the report yet.
    outstanding_at_report: int = 0
    # Newest capacity summary (replicas combined) and when it arrived (this tier's
    # monotonic clock); the newest summary of each publishing replica.
    summary: capacity_pb2.CapacitySummary | None = None
    summary_received_at: float = 0.0
    replicas: dict[str, tuple[capacity_pb2.CapacitySummary, float]] = field(
        default_factory=dict, repr=False
    )
    # A compact capacity hint from the child's last response, fresher than summaries.
    hint: capacity_pb2.ModelCapacity | None = None
    hint_at: float = float("-inf")
    stub: pb_grpc.GRPCInferenceServiceStub | None = field(default=None, repr=False)
    # The channel under ``stub`` (the Admin API calls the child's tier over it too).
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    # How to dial this child when it differs from its set's (a GPU that serves TLS).
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)
    # False once its ModelStreamInfer proved not Triton's (common.request.stream_request).
    streams: bool = True

    def fresh_summary(self, now: float, ttl_s: float) -> capacity_pb2.CapacitySummary | None:
        """The summary if younger than ``ttl_s``; a stale one reads as unknown (None)."""
        if self.summary is None or now - self.summary_received_at > ttl_s:
            return None
        return self.summary

    def model_capacity(self, model: str, now: float, ttl_s: float) -> Capacity | None:
        """The newest fresh report for ``model`` (summary entry or hint); None if unknown."""
        if self.hint is not None and self.hint.model == model and now - self.hint_at <= ttl_s:
            if self.hint_at >= self.summary_received_at:
                return self.hint
        summary = self.fresh_summary(now, ttl_s)
        if summary is None:
            return None
        for entry in summary.models:
            if entry.model == model:
                return entry
        return None

    def may_serve(self, model: str, now: float, ttl_s: float) -> bool:
        return self.serving_capacity(model, now, ttl_s)[0]

    def serving_capacity(self, model: str, now: float, ttl_s: float) -> Serving:
        """``may_serve`` (healthy by direct evidence, not drained, serves ``model``, no fresh
        summary says it has no healthy GPU: stale or unknown proves nothing), and the report."""
        if not self.healthy or self.drained or model not in self.models:
            return False, None
        entry = self.model_capacity(model, now, ttl_s)
        return entry is None or entry.healthy_gpus > 0 or entry.unknown_children > 0, entry


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
        credentials: grpc.ChannelCredentials | None = None,
        keepalive: Keepalive | None = None,
    ) -> None:
        self.children = tuple(children)
        # TLS towards the children (common.config.tls.tier_channel_credentials); None: plaintext.
        self.credentials = credentials
        # Keepalive towards the children (default: as between tiers).
        self._options = channel_options(keepalive or Keepalive())
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
        self._tasks: list[asyncio.Task[None]] = []
        # Per child: its health watch; children being retired (common.operations.reload).
        self._watches: dict[str, asyncio.Task[None]] = {}
        # Per child (by identity: a retiring child and its successor may share a name).
        self._checkers: dict[Child, HealthChecker] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._leaving: set[str] = set()
        # While ``changes()`` holds the notifications: whether something changed.
        self._held: bool | None = None

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _changed(self) -> None:
        if self._held is not None:
            self._held = True
            return
        for listener in self._listeners:
            listener()

    @contextlib.contextmanager
    def changes(self) -> Iterator[None]:
        """Hold the listeners' notifications for a block of health changes (the local
        tier re-derives every GPU at once): one at its end, if any changed."""
        if self._held is not None:  # nested: the outer block notifies
            yield
            return
        self._held = False
        try:
            yield
        finally:
            changed, self._held = self._held, None
            if changed:
                self._changed()

    def settings_changed(self) -> None:
        """A kept child's settings (models, location) changed: tell the listeners."""
        self._changed()

    def __iter__(self) -> Iterator[Child]:
        return iter(self.children)

    def _open(self, child: Child) -> None:
        if child.stub is not None and child.channel is None:
            return  # it came with a stub of another protocol (an OpenAI GPU): no channel
        channel = dial(child.endpoint.address, child.credentials or self.credentials, self._options)
        self._channels.append(channel)
        child.channel, child.stub = channel, pb_grpc.GRPCInferenceServiceStub(channel)
        self._checkers[child] = HealthChecker(channel, name=child.name)

    def _start_watch(self, child: Child) -> None:
        checker = self._checkers[child]
        task = asyncio.create_task(self._watch(child, checker), name=f"watch {child.name}")
        self._watches[child.name] = task

    async def start(self) -> None:
        for child in self.children:
            self._open(child)
        if self.probe:
            await self.probe_all()
            self._tasks.append(asyncio.create_task(self._probe_loop(), name="child-probes"))
            for child in self.children:
                self._start_watch(child)

    async def stop(self) -> None:
        await cancel_and_wait([*self._tasks, *self._watches.values(), *self._retiring])
        for channel in self._channels:
            await channel.close()

    # ------------------------------------------------------------------ admin changes

    def set_drained(self, child: Child, drained: bool) -> bool:
        """Drain (no new requests; in-flight ones finish) or undrain ``child``;
        False (nothing done) for undraining a child being retired, which stays
        drained until it is gone.

        Health watching goes on, and a drained child is not a failure: nothing
        is marked down. Listeners hear of it at once (publishers publish the
        lost capacity, the local tier drops the GPU from its free pools)."""
        if not drained and child.name in self._leaving:
            return False
        if child.drained != drained:
            log.info("%s %s %s", self.kind, child.name, "drained" if drained else "undrained")
            child.drained = drained
            self._changed()
        return True

    async def add(self, child: Child) -> None:
        """A child new in a reloaded topology: open its channel, watch its health."""
        if child.name in self.by_name:
            raise ValueError(f"{self.kind} {child.name!r} already exists")
        self._open(child)
        self.children = (*self.children, child)
        self.by_name[child.name] = child
        if self.probe:
            await self._probe(child)
            self._start_watch(child)
        self._changed()

    def retire(
        self,
        child: Child,
        on_gone: Callable[[Child], Awaitable[None]] | None = None,
        poll_s: float = 0.05,
    ) -> None:
        """A child gone from a reloaded topology: drain it now for good; once its
        in-flight calls have ended (polled every ``poll_s``: the balancers write a
        plain counter, there is no event), run ``on_gone``, forget it, stop watching
        it, and close its channel once no call is on it. A second retire is a no-op."""
        if child.name in self._leaving:
            return
        self._leaving.add(child.name)
        self.set_drained(child, True)

        async def finish() -> None:
            try:
                await _idle(child, poll_s)
                if on_gone is not None:
                    try:
                        await on_gone(child)
                    except Exception:  # its own state is the caller's; forget it anyway
                        log.exception("%s %s: clean-up on removal failed", self.kind, child.name)
            finally:
                self._leaving.discard(child.name)
            self.children = tuple(c for c in self.children if c is not child)
            if self.by_name.get(child.name) is child:
                del self.by_name[child.name]
            watch = self._watches.pop(child.name, None)
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            self._checkers.pop(child, None)
            self._changed()
            await _idle(child, poll_s)
            if child.channel is not None:
                self._channels.remove(child.channel)
                await child.channel.close()
            log.info("%s %s removed", self.kind, child.name, extra={"event": "child_removed"})

        task = asyncio.create_task(finish(), name=f"retire {child.name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def leaving(self, name: str) -> bool:
        """True while child ``name`` is retired but still finishing in-flight calls."""
        return name in self._leaving

    def mark_failed(self, child: Child, error: str) -> None:
        """A forward to ``child`` failed: stop routing to it until a probe succeeds."""
        if child.healthy:
            down = {"event": "child_down", "child": child.name, "error": error}
            log.warning("%s %s marked down: %s", self.kind, child.name, error, extra=down)
            child.healthy = False
            self._changed()
        child.last_error = error

    def mark_healthy(self, child: Child) -> None:
        if not child.healthy:
            fields = {"event": "child_up", "child": child.name}
            log.info("%s %s is back", self.kind, child.name, extra=fields)
            child.healthy = True
            child.healthy_since = self.clock()
            child.last_error = ""
            self._changed()

    def take_summary(self, child_name: str, summary: capacity_pb2.CapacitySummary) -> None:
        """Record a summary from the Redis reader.

        Kept per publishing replica (older sequences of a source are ignored,
        replicas past the TTL dropped) and combined without double counting.
        A significant change (healthy GPUs, or a utilisation band crossed)
        notifies the listeners at once.
        """
        child = self.by_name.get(child_name)
        if child is None:
            return
        now = self.clock()
        known = child.replicas.get(summary.source_id)
        if known is not None and summary.sequence <= known[0].sequence:
            return
        child.replicas[summary.source_id] = (summary, now)
        for source, (_, at) in list(child.replicas.items()):
            if now - at > self.summary_ttl_s:
                del child.replicas[source]
        old = child.summary
        child.summary = combine_replicas([s for s, _ in child.replicas.values()])
        child.summary_received_at = now
        child.outstanding_at_report = child.outstanding_requests
        if old is None or significant_change(old, child.summary):
            self._changed()

    def take_hint(self, child: Child, hint: capacity_pb2.ModelCapacity | None) -> None:
        """Record the capacity hint a child put on a response.

        Only a hint that says something new (another publication of the child's)
        restarts the count of what was sent since its report: every answer repeats
        the child's newest publication until its next one, and restarting the count
        on each repeat forgot everything sent since that publication, so an idle-
        looking child took all traffic until it published again (the fleet
        simulator: regions taking 0 requests, then 4 500 a second, in turns)."""
        if hint is None:
            return
        if hint != child.hint:
            child.outstanding_at_report = child.outstanding_requests
        child.hint = hint
        child.hint_at = self.clock()

    def nothing_healthy(
        self, model: str, tried: Collection[str] = (), only: Collection[str] = ()
    ) -> str:
        """Why no child can take a request for ``model``: each child and its state."""
        states = []
        for c in self.children:
            if model not in c.models or (only and c.name not in only):
                continue
            why = (
                "already tried"
                if c.name in tried
                else "drained"
                if c.drained
                else c.last_error or "no capacity"
            )
            states.append(f"{c.name} ({why})")
        return f"no healthy {self.kind} can serve model {model!r}: " + "; ".join(states)

    def any_healthy(self) -> bool:
        return any(c.healthy for c in self.children)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(c) for c in self.children))

    async def _probe(self, child: Child) -> None:
        checker = self._checkers.get(child)
        if checker is None:  # retired meanwhile
            return
        self._report(child, *await checker.server_ready(max(0.2, self.probe_interval_s)))

    def _report(self, child: Child, healthy: bool, reason: str) -> None:
        """A health report (a probe, a watch): mark ``child`` up or down."""
        if healthy:
            self.mark_healthy(child)
        else:
            self.mark_failed(child, reason)

    async def _probe_loop(self) -> None:
        """Re-probe the children marked down (a health watch reports only changes, and a
        failed forward may have marked down a child whose health never changed)."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                down = [c for c in self.children if not c.healthy and c.stub is not None]
                await asyncio.gather(*(self._probe(c) for c in down))
            except Exception:  # a probe bug must not stop probing
                log.exception("health probe round failed")

    async def _watch(self, child: Child, checker: HealthChecker) -> None:
        """Follow the child's grpc.health.v1 Watch: a child that stops serving, or whose
        process dies (the stream breaks), is marked down at once. Without a health
        service, its ServerReady every probe interval (``HealthChecker.watch``)."""
        await checker.watch(functools.partial(self._report, child), self.probe_interval_s)


async def _idle(child: Child, poll_s: float) -> None:
    """Return once no call this tier sent to ``child`` is in flight."""
    while child.outstanding_requests > 0:  # noqa: ASYNC110 (a plain counter, no event)
        await asyncio.sleep(poll_s)
