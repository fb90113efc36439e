"""A tier's view of its children: channels, direct health evidence, load, summaries.

Every tier routes over a ``ChildSet``. It owns one gRPC channel per child, with
keepalive (a hung child's calls fail UNAVAILABLE and its Watch breaks within
``time_s + timeout_s``; a tier child's channel reaches every replica behind its
name: ``common.request.replicas``), follows each child's grpc.health.v1 Watch (or
ServerReady without one; re-probed while a child is down; ``common.request.health``),
and takes capacity summaries from the Redis reader. Pickers read ``Child`` state
(``common.request.child``); only this module and the proxy core write it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator

import grpc

from common.basics.tasks import cancel_and_wait
from common.capacity.summary import combine_replicas, repeats_hint, significant_change
from common.config.liveness import Keepalive
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import capacity_pb2
from common.request.child import Child
from common.request.health import HealthChecker
from common.request.replicas import replica_channel_options, replica_target
from common.request.server import channel_options, dial

log = logging.getLogger(__name__)

Clock = Callable[[], float]
__all__ = ["Child", "ChildSet"]  # Child is defined in common.request.child


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
        dns: str | None = None,
    ) -> None:
        self.children = tuple(children)
        # TLS towards the children (common.config.tls.tier_channel_credentials); None: plaintext.
        self.credentials = credentials
        # Keepalive towards the children (default: as between tiers).
        self._options: list[tuple[str, str | int]] = [*channel_options(keepalive or Keepalive())]
        # Tier children: resolved by this resolver (``dns:///``...), calls spread over
        # every replica; None (GPUs): one endpoint each, dialled as it is.
        self.dns = dns
        if dns is not None:
            self._options.extend(replica_channel_options())
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
        # Probes sent at once after a failed forward to a child dialled by name.
        self._reprobes: set[asyncio.Task[None]] = set()
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
        target = child.endpoint.address
        if self.dns is not None:
            target = replica_target(child.endpoint, self.dns)
        channel = dial(target, child.credentials or self.credentials, self._options)
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
        tasks = [*self._tasks, *self._watches.values(), *self._retiring, *self._reprobes]
        await cancel_and_wait(tasks)
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

    def mark_failed(self, child: Child, error: str, *, probed: bool = False) -> None:
        """A forward to ``child`` failed (or, ``probed``, a probe or watch said so): stop
        routing to it until a probe succeeds. A child dialled by name is probed at once
        after a failed forward: the call may have met one dead replica of several."""
        if child.healthy:
            down = {"event": "child_down", "child": child.name, "error": error}
            log.warning("%s %s marked down: %s", self.kind, child.name, error, extra=down)
            child.healthy = False
            self._changed()
            if not probed and self.dns is not None and self.probe:
                task = asyncio.get_running_loop().create_task(self._probe(child))
                self._reprobes.add(task)
                task.add_done_callback(self._reprobes.discard)
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
        if child.hint is not None and repeats_hint(child.summary, child.hint):
            # The publication a response already brought as a hint: what was sent and
            # came back since that hint still counts, or the returns would be forgotten.
            child.hint_at = now
        else:
            child.outstanding_at_report = child.outstanding_requests
            child.outstanding_work_at_report = child.outstanding_work
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
            child.outstanding_work_at_report = child.outstanding_work
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
            self.mark_failed(child, reason, probed=True)

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
