"""Lifecycle of one tier process: children, proxy, gRPC server, Redis publisher and reader.

``TierServer`` owns them all and tears them down in reverse order:
stop accepting and let in-flight calls finish, stop Redis work, close
child channels.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from opentelemetry import trace

from common.capacity.streams import CapacityPublisher, CapacityReader
from common.config.access import Limits
from common.config.liveness import Keepalive
from common.config.node import Endpoint
from common.config.tls import TierTls, tier_server_credentials
from common.observability.decisions import DecisionCounter
from common.observability.dependency_metrics import add_redis_metrics, add_usage_metrics
from common.observability.logs import ShedLog
from common.observability.tier_metrics import CountingRetryBudget, TierMetrics
from common.observability.tracing import Telemetry, TierTracing
from common.operations.admin import ADMIN_SERVICE, AdminService
from common.operations.ops_access import OpsAccess
from common.operations.ops_http import OpsAdditions, OpsServer
from common.request.balancer import Balancer
from common.request.call import CallInterceptor, CallObserver
from common.request.children import ChildSet
from common.request.forwarding import Forwarder, ForwardingPolicy
from common.request.openai_http import OpenAIEdge
from common.request.peers import parent_only
from common.request.proxy import InferenceProxy, TierSpec
from common.request.server import V2Server
from common.tenancy.admission import Admission
from common.tenancy.shared_redis import QuotaRedis
from common.tier.client_entry import OpenAIFront

log = logging.getLogger(__name__)


def no_hint(model: str) -> None:
    return None


def source_id(tier: str, *names: str) -> str:
    """A publisher identity unique to this process incarnation, so a restarted
    publisher's sequence numbers (from 1 again) are never taken for old ones."""
    return "/".join((tier, *names, f"{os.getpid()}-{secrets.token_hex(3)}"))


class Service(Protocol):
    """A background component a tier owns (health monitor, periodic refresh)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _shared_up(shared: QuotaRedis) -> bool:
    return not shared.degraded


# How long a stopping tier keeps accepting after it said NOT_SERVING.
DRAIN_NOTICE_S = 0.3


@dataclass
class TierServer:
    """One running tier: serves V2 on ``endpoint`` and forwards to ``children``.

    It builds the parts every tier has alike, in the order they need each other:
    metrics (whose retry counter the forwarding loop's budget carries), the
    tracing, the forwarding loop, the proxy, the gRPC server with the call
    interceptor (tracing, metrics, usage), the OpenAI HTTP edge (``openai``: into the
    same proxy at the edge tier; at an inner tier through its clients' own entry,
    ``common.tier.client_entry``), the ops HTTP and the Admin API.
    """

    spec: TierSpec
    policy: ForwardingPolicy
    children: ChildSet
    balancer: Balancer
    endpoint: Endpoint
    publisher: CapacityPublisher | None = None
    reader: CapacityReader | None = None
    services: list[Service] = field(default_factory=list)
    admission: Admission | None = None
    limits: Limits = field(default_factory=Limits)
    # How the server pings its callers (common.request.keepalive).
    keepalive: Keepalive = field(default_factory=Keepalive)
    telemetry: Telemetry | None = None
    # This instance's TLS (common.config.tls); None: a plaintext fleet. An inner tier
    # serves mutual TLS to its parent only, the edge server-side TLS when client-facing.
    tls: TierTls | None = None
    # Ops HTTP (common.operations.ops_http) on this address, named ``name`` in
    # /api/state, with the tier's own additions; None: not served.
    ops: Endpoint | None = None
    ops_additions: OpsAdditions = field(default_factory=OpsAdditions)
    # Who may read the ops HTTP's data (default: anyone; the tiers pass auth's rule).
    ops_access: OpsAccess = field(default_factory=OpsAccess)
    name: str = ""
    # Configured tenant ids: the only values the metrics' tenant label takes.
    tenants: frozenset[str] = frozenset()
    # The Admin API (common.operations.admin), served on the same port; None: not served.
    admin: AdminService | None = None
    # OpenAI-compatible HTTP into this tier's request path (common.request.openai_http);
    # None: not served. At the edge tier its calls are the V2 port's; at an inner tier
    # they are clients' and enter through its gate (common.tier.client_entry).
    openai: OpenAIFront | None = None

    def __post_init__(self) -> None:
        self._ready = True
        self._started = False
        self._pending: set[asyncio.Task[None]] = set()
        self.metrics = TierMetrics(
            self.spec.tier,
            self.children,
            models=frozenset(m for c in self.children for m in c.models),
            tenants=self.tenants,
            summaries=self.reader is not None,  # children that publish capacity summaries
        )
        for add in self.ops_additions.metrics:
            add(self.metrics)
        self._dependency_metrics()
        self.tracing = tracing = (
            TierTracing(trace.NoOpTracer(), self.spec.tier)
            if self.telemetry is None
            else TierTracing(self.telemetry.tracer, self.spec.tier, self.telemetry.propagator)
        )
        self.forwarder = Forwarder(
            self.policy,
            DecisionCounter(self.balancer, self.metrics.decided),
            budget=CountingRetryBudget(self.metrics.retries.labels(self.spec.tier)),
            tracing=tracing if tracing.enabled else None,
            hint_source=self.publisher.latest_hint if self.publisher is not None else no_hint,
        )
        self.proxy = InferenceProxy(
            self.spec,
            self.children,
            self.balancer,
            self.forwarder,
            gate=self.admission,
            limits=self.limits,
        )
        self.server = self._v2_server(tracing)
        self.openai_edge = None if self.openai is None else self._openai_edge(self.openai)
        if self.admin is not None:
            self.server.add_service(self.admin.register, ADMIN_SERVICE)
        self.ops_server = (
            None
            if self.ops is None
            else OpsServer(
                self.ops,
                self.name,
                self.metrics,
                recent=self.telemetry.recent if self.telemetry is not None else None,
                child_details=self.ops_additions.child_details,
                extra_state=self.ops_additions.extra_state,
                extensions=self.ops_additions.extensions,
                access=self.ops_access,
            )
        )
        if self.publisher is not None:
            self.children.add_listener(self.publisher.poke)
        self.children.add_listener(self._readiness_changed)
        # A child came or left, or a reload changed a kept child's models: a model
        # nobody serves any more is NOT_FOUND again, a new one is served.
        self.children.add_listener(self._children_changed)

    def _dependency_metrics(self) -> None:
        """Its Redis clients' state and, where it writes usage, the records' progress."""
        add_redis_metrics(self.metrics, self._redis_clients())
        usage = next((a.usage for a in self._admissions() if a.usage is not None), None)
        if usage is not None:  # one edge per tier writes usage: its V2 port or its clients'
            add_usage_metrics(self.metrics, usage)

    def _redis_clients(self) -> dict[str, Callable[[], bool]]:
        """Whether each of the tier's Redis clients is connected, for ``meridian_redis_up``."""
        clients: dict[str, Callable[[], bool]] = {}
        if self.publisher is not None:
            clients["capacity_publisher"] = self.publisher.redis_up
        if self.reader is not None:
            clients["capacity_reader"] = self.reader.redis_up
        # The edge's tenant limits, on the Redis they share (down: limited in process).
        for gate in self._admissions():
            if gate.limiter is not None:
                clients["quota"] = partial(_shared_up, gate.limiter.shared)
            if gate.concurrency is not None:
                clients["concurrency"] = partial(_shared_up, gate.concurrency.shared)
        return clients

    def _admissions(self) -> list[Admission]:
        """The tier's admission and its OpenAI clients' (an inner tier's edge), if any."""
        gate = self.openai.gate if self.openai is not None else None
        gates = [self.admission, gate.admission if gate is not None else None]
        return [a for a in gates if a is not None]

    def _observers(self, tracing: TierTracing) -> list[CallObserver]:
        """What observes every inference call of the tier: tracing, metrics, the shed log."""
        observers: list[CallObserver] = [tracing] if tracing.enabled else []
        observers.append(self.metrics)
        observers.append(self.shed_log)
        return observers

    def _v2_server(self, tracing: TierTracing) -> V2Server:
        """The gRPC server, its calls observed by tracing, metrics and (at the edge) usage."""
        self.shed_log = ShedLog(self.spec.tier)  # sheds as one summary line per burst
        observers = self._observers(tracing)
        if self.admission is not None and self.admission.usage is not None:
            observers.append(self.admission)
        edge = not self.spec.trust_internal  # the tier clients call
        # The parent check runs inside the call interceptor, so a refused call is still
        # traced and counted (common.request.peers: an inner tier serves only its parent).
        # Kept: another front end on the proxy (the OpenAI edge) observes its calls with it.
        self.calls = CallInterceptor(observers)
        return V2Server(
            self.proxy,
            self.endpoint,
            credentials=tier_server_credentials(self.tls, edge=edge),
            limits=self.limits,
            interceptors=[
                self.calls,
                *parent_only(None if self.tls is None or edge else self.tls.identity),
            ],
            keepalive=self.keepalive,
            edge=edge,
        )

    def _openai_edge(self, front: OpenAIFront) -> OpenAIEdge:
        """OpenAI HTTP into this tier: the edge tier's own proxy and calls; at an inner
        tier a proxy and interceptor of the clients' own (common.tier.client_entry) on
        the same children, balancer and forwarding loop."""
        gate = front.gate
        if gate is None:
            if self.spec.trust_internal:
                raise ValueError(
                    f"the {self.spec.tier} tier trusts its V2 callers: its OpenAI edge, "
                    "which clients call, needs a gate (common.tier.client_entry)"
                )
            return OpenAIEdge(front.config, self.proxy, self.calls)
        proxy = InferenceProxy(
            gate.client_spec(self.spec),
            self.children,
            self.balancer,
            self.forwarder,
            gate=gate,
            limits=self.limits,
        )
        calls = CallInterceptor([*self._observers(self.tracing), gate])
        return OpenAIEdge(front.config, proxy, calls)

    def _children_changed(self) -> None:
        models = frozenset(m for c in self.children.children for m in c.models)
        if models != self.proxy.models:
            self.proxy.serve_models(models)
        if self.openai_edge is not None and models != self.openai_edge.proxy.models:
            self.openai_edge.proxy.serve_models(models)

    def _readiness_changed(self) -> None:
        """Serve grpc.health.v1 SERVING only while some child is up: the tier above
        watches it and stops sending here at once."""
        ready = self.children.any_healthy()
        if ready != self._ready and self._started:
            self._ready = ready
            task = asyncio.get_running_loop().create_task(self.server.set_serving(ready))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> None:
        if self.reader is not None:
            self.reader.start()
        await self.children.start()
        if self.admission is not None:
            await self.admission.start()
        if self.openai is not None and self.openai.gate is not None:
            await self.openai.gate.start()
        for service in self.services:
            await service.start()
        if self.openai_edge is not None:
            await self.openai_edge.start()
        await self.server.start()
        self.tracing.serve_at(self.endpoint.host, self.server.port)
        if self.ops_server is not None:
            await self.ops_server.start()
        self._ready = self.children.any_healthy()
        await self.server.set_serving(self._ready)
        self._started = True
        if self.publisher is not None:
            self.publisher.start()

    async def stop(self, grace: float = 5.0) -> None:
        if self.ops_server is not None:
            self.ops_server.draining = True
        if self._started and grace > 0:
            # Say NOT_SERVING first and give the tier above (watching our health) a
            # moment to stop sending, so few new calls race with the shutdown.
            await self.server.stop_serving()
            await asyncio.sleep(min(DRAIN_NOTICE_S, grace))
        await self.server.stop(grace)
        if self.openai_edge is not None:  # its calls in flight finish first
            await self.openai_edge.stop()
        self.shed_log.flush()  # both entries' sheds
        if self.ops_server is not None:
            await self.ops_server.stop()
        if self.publisher is not None:
            await self.publisher.stop()
        if self.reader is not None:
            await self.reader.stop()
        for service in reversed(self.services):
            await service.stop()
        if self.openai is not None and self.openai.gate is not None:
            await self.openai.gate.stop()  # flushes its usage records
        if self.admission is not None:
            await self.admission.stop()
        await self.children.stop()
        if self.telemetry is not None:
            self.telemetry.shutdown()

    async def serve_until(self, stop_event: asyncio.Event, grace: float = 5.0) -> None:
        """Start, log where it listens, run until ``stop_event``, stop gracefully."""
        await self.start()
        where = {"tier": self.spec.tier, "instance": self.name, "address": self.server.address}
        ops = f"http://{self.ops_server.address}/" if self.ops_server is not None else None
        fields = {"event": "tier_started", **where, "ops": ops}
        also = f", ops {ops}" if ops else ""
        log.info("%s tier listening %s%s", self.spec.tier, where["address"], also, extra=fields)
        try:
            await stop_event.wait()
        finally:
            log.info("%s tier stopping", self.spec.tier, extra={"event": "tier_stopping", **where})
            await self.stop(grace)
            log.info("%s tier stopped", self.spec.tier, extra={"event": "tier_stopped", **where})
