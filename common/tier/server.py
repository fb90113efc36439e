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
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from common.capacity.streams import CapacityPublisher, CapacityReader
from common.config.access import Limits
from common.config.node import Endpoint
from common.observability.tier_metrics import CountingRetryBudget, TierMetrics
from common.observability.tracing import Telemetry
from common.operations.admin import ADMIN_SERVICE, AdminService
from common.operations.ops_http import OpsServer
from common.request.balancer import Balancer
from common.request.children import ChildSet
from common.request.proxy import InferenceProxy, TierSpec
from common.request.server import V2Server
from common.tenancy.admission import Admission

log = logging.getLogger(__name__)


def source_id(tier: str, *names: str) -> str:
    """A publisher identity unique to this process incarnation, so a restarted
    publisher's sequence numbers (from 1 again) are never taken for old ones."""
    return "/".join((tier, *names, f"{os.getpid()}-{secrets.token_hex(3)}"))


class Service(Protocol):
    """A background component a tier owns (health monitor, periodic refresh)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# How long a stopping tier keeps accepting after it said NOT_SERVING.
DRAIN_NOTICE_S = 0.3


@dataclass
class TierServer:
    """One running tier: serves V2 on ``endpoint`` and forwards to ``children``."""

    spec: TierSpec
    children: ChildSet
    balancer: Balancer
    endpoint: Endpoint
    publisher: CapacityPublisher | None = None
    reader: CapacityReader | None = None
    services: list[Service] = field(default_factory=list)
    admission: Admission | None = None
    limits: Limits = field(default_factory=Limits)
    telemetry: Telemetry | None = None
    # TLS for the served port (common.config.tls.tier_server_credentials); None: plaintext.
    credentials: grpc.ServerCredentials | None = None
    # Ops HTTP (common.operations.ops_http) on this address, named ``name`` in
    # /api/state; None: not served.
    ops: Endpoint | None = None
    name: str = ""
    # Configured tenant ids: the only values the metrics' tenant label takes.
    tenants: frozenset[str] = frozenset()
    # The Admin API (common.operations.admin), served on the same port; None: not served.
    admin: AdminService | None = None

    def __post_init__(self) -> None:
        self.proxy = InferenceProxy(
            self.spec,
            self.children,
            self.balancer,
            admission=self.admission,
            limits=self.limits,
            tracer=self.telemetry.tracer if self.telemetry is not None else None,
        )
        self._ready = True
        self._started = False
        self._pending: set[asyncio.Task[None]] = set()
        self.metrics = TierMetrics(
            self.spec.tier,
            self.children,
            models=frozenset(m for c in self.children for m in c.models),
            tenants=self.tenants,
            trust_tenant=self.spec.trust_internal,
        )
        self.proxy.retry_budget = CountingRetryBudget(self.metrics.retries.labels(self.spec.tier))
        self.server = V2Server(
            self.proxy,
            self.endpoint,
            credentials=self.credentials,
            limits=self.limits,
            interceptors=[self.metrics.interceptor()],
        )
        if self.admin is not None:
            self.server.add_service(self.admin.register, ADMIN_SERVICE)
            self.admin.on_reloaded = self._children_reloaded
        self.ops_server = None if self.ops is None else OpsServer(self.ops, self.name, self.metrics)
        if self.ops_server is not None and self.telemetry is not None:
            self.ops_server.recent = self.telemetry.recent
        if self.publisher is not None:
            self.children.add_listener(self.publisher.poke)
            self.proxy.hint_source = self.publisher.latest_hint
        self.children.add_listener(self._readiness_changed)
        # The child tuple the served models were derived from (ChildSet replaces it
        # when a child is added or finally leaves).
        self._members = self.children.children
        self.children.add_listener(self._membership_changed)

    def _children_reloaded(self) -> None:
        """A reloaded topology may add models or change a kept child's; a removed
        child's models go when it has finally left (``_membership_changed``)."""
        self._members = self.children.children
        self.proxy.models = frozenset(m for c in self._members for m in c.models)

    def _membership_changed(self) -> None:
        """A child came or left: a model nobody serves any more is NOT_FOUND again."""
        if self.children.children is not self._members:
            self._children_reloaded()

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
        for service in self.services:
            await service.start()
        await self.server.start()
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
            await self.server.set_serving(False)
            await asyncio.sleep(min(DRAIN_NOTICE_S, grace))
        await self.server.stop(grace)
        if self.ops_server is not None:
            await self.ops_server.stop()
        if self.publisher is not None:
            await self.publisher.stop()
        if self.reader is not None:
            await self.reader.stop()
        for service in reversed(self.services):
            await service.stop()
        if self.admission is not None:
            await self.admission.stop()
        await self.children.stop()
        if self.telemetry is not None:
            self.telemetry.shutdown()

    async def serve_until(self, stop_event: asyncio.Event, grace: float = 5.0) -> None:
        """Start, print where it listens, run until ``stop_event``, stop gracefully."""
        await self.start()
        print(f"{self.spec.tier} listening {self.server.address}", flush=True)
        if self.ops_server is not None:
            print(f"{self.spec.tier} ops http://{self.ops_server.address}/", flush=True)
        try:
            await stop_event.wait()
        finally:
            await self.stop(grace)
