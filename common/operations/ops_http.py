"""The ops HTTP of one tier.

``OpsServer`` serves, over plain HTTP (aiohttp) on the tier's ``ops_listen``:

* ``/healthz``: 200 while the process runs (liveness);
* ``/readyz``: 200 while some child is healthy (``children.any_healthy()``), else 503
  (also 503 once the tier has begun to stop);
* ``/api/state``: JSON view of the tier and its children;
* ``/metrics``: the tier's registry in the Prometheus text format 0.0.4, or in
  OpenMetrics 1.0 (with the trace ids of latency observations as exemplars) when
  the scraper's ``Accept`` asks for ``application/openmetrics-text``;
* ``/api/traces``: this tier's recent traces (``?limit=N``, ``?ids=a,b`` for given ones);
* ``/api/series``: requests per second and latency per second, last five minutes
  (``common.observability.series``).

With ``auth.enabled`` on, ``/metrics`` and the probes stay open and the data
(``/api/*``) needs an operator key (``common.operations.ops_access``).

A tier may add its own routes (``extensions``: the global tier's dashboard) and
details per child or for the whole tier (``child_details``, ``extra_state``).

The metrics it serves are defined in ``common.observability.tier_metrics``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from google.protobuf.json_format import MessageToDict
from opentelemetry.sdk.trace import ReadableSpan

from common.basics.ticker import Ticker
from common.config.node import Endpoint
from common.observability.metrics import exposition
from common.observability.series import RequestSeries
from common.observability.tier_metrics import TierMetrics
from common.observability.tracing import RecentSpans
from common.operations.ops_access import OPEN, OpsAccess  # OpsAccess: also for the tiers
from common.request.children import Child, ChildSet

UNKNOWN_LABEL = "-"


ChildDetails = Callable[[Child], dict[str, Any]]


class OpsExtension(Protocol):
    """Routes a tier adds to its ops HTTP (the global's fleet view and dashboard)."""

    def install(self, app: web.Application, ops: OpsServer) -> None: ...


@dataclass(frozen=True)
class OpsAdditions:
    """What a tier adds to the ops surface: metric families (each called with the
    tier's ``TierMetrics``), per-child details and tier-wide state in /api/state,
    and routes (``extensions``)."""

    metrics: Sequence[Callable[[TierMetrics], None]] = ()
    child_details: ChildDetails | None = None
    extra_state: Callable[[], dict[str, Any]] | None = None
    extensions: Sequence[OpsExtension] = ()


def child_state(
    children: ChildSet, now: float, details: ChildDetails | None = None
) -> list[dict[str, Any]]:
    """Each child as ``/api/state`` shows it (plus the tier's own ``details``)."""
    out = []
    for c in children:
        out.append(
            {
                "name": c.name,
                "endpoint": c.endpoint.address,
                "healthy": c.healthy,
                "drained": c.drained,
                "last_error": c.last_error,
                "outstanding_requests": c.outstanding_requests,
                "summary_age_s": None if c.summary is None else now - c.summary_received_at,
                "summary": None if c.summary is None else MessageToDict(c.summary),
                "hint": None if c.hint is None else MessageToDict(c.hint),
                "hint_age_s": None if c.hint is None else now - c.hint_at,
            }
        )
        if details is not None:
            out[-1].update(details(c))
    return out


def span_json(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as the dashboard and `/api/traces` show it."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "span_id": f"{ctx.span_id:016x}" if ctx else "",
        "parent_id": f"{parent.span_id:016x}" if parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {
            k: v if isinstance(v, str | int | float | bool) else str(v)
            for k, v in (span.attributes or {}).items()
        },
        "status": span.status.status_code.name,
    }


class OpsServer:
    """The ops HTTP endpoint of one tier; owns its aiohttp runner.

    ``start()`` binds ``endpoint`` (port 0 picks a free port; ``port`` tells which),
    ``stop()`` closes the listener and the runner. ``access`` says who may read what
    (default: anyone everything).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        name: str,
        metrics: TierMetrics,
        *,
        recent: RecentSpans | None = None,
        child_details: ChildDetails | None = None,
        extra_state: Callable[[], dict[str, Any]] | None = None,
        extensions: Sequence[OpsExtension] = (),
        access: OpsAccess = OPEN,
    ) -> None:
        self.endpoint = endpoint
        self.access = access
        self.name = name
        self.metrics = metrics
        self.children = metrics.children
        self.port = endpoint.port
        # Set when the tier begins to stop: /readyz answers 503 from then on.
        self.draining = False
        # The tier's recent finished spans (None when traces are exported instead).
        self.recent = recent
        self.series = RequestSeries(metrics.requests, metrics.duration)
        self._sampler = Ticker(self.series.sample, 1.0)
        # What a tier adds: per-child and tier-wide state, and routes (installed on
        # the app when it is built).
        self.child_details = child_details
        self.extra_state = extra_state
        self.extensions = tuple(extensions)
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return Endpoint(self.endpoint.host, self.port).address

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.access.middleware])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/traces", self._traces)
        app.router.add_get("/api/series", self._series)
        for extension in self.extensions:
            extension.install(app, self)
        return app

    async def start(self) -> None:
        # Bound here (not by aiohttp) so port 0 tells which port it got; a taken port fails.
        family = socket.AF_INET6 if ":" in self.endpoint.host else socket.AF_INET
        sock = socket.create_server((self.endpoint.host, self.endpoint.port), family=family)
        self.port = sock.getsockname()[1]
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            sock.close()
            raise
        self._runner = runner
        self.series.sample()  # the baseline the first point is measured from
        await self._sampler.start()

    async def stop(self) -> None:
        await self._sampler.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.Response(status=503, text="not ready: stopping\n")
        if self.children.any_healthy():
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: no healthy {self.children.kind}\n")

    def state(self) -> dict[str, Any]:
        """The tier and its children, as ``/api/state`` serves them."""
        body = {
            "tier": self.metrics.tier,
            "name": self.name,
            "ready": self.children.any_healthy(),
            "children": child_state(self.children, self.children.clock(), self.child_details),
        }
        if self.extra_state is not None:
            body.update(self.extra_state())
        return body

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    def traces(self, limit: int, ids: Collection[str] | None = None) -> dict[str, Any]:
        """This tier's newest ``limit`` traces (only ``ids`` when given), newest first."""
        if self.recent is None:
            return {"traces": [], "note": "spans are exported over OTLP"}
        grouped = self.recent.traces()
        if ids is not None:
            grouped = {tid: spans for tid, spans in grouped.items() if tid in ids}
        traces = sorted(
            grouped.items(),
            key=lambda item: max(span.start_time or 0 for span in item[1]),
            reverse=True,
        )[:limit]
        return {
            "traces": [
                {"trace_id": tid, "spans": [span_json(s) for s in spans]} for tid, spans in traces
            ]
        }

    async def _traces(self, request: web.Request) -> web.Response:
        """Recent traces of this tier, newest first (``?limit=N``, default 50;
        ``?ids=a,b`` only those trace ids)."""
        try:
            limit = max(1, min(500, int(request.query.get("limit", "50"))))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        ids = request.query.get("ids")
        wanted = None if ids is None else frozenset(i for i in ids.split(",") if i)
        return web.json_response(self.traces(limit, wanted))

    async def _series(self, request: web.Request) -> web.Response:
        """Per-second requests, failures and OK latency (``?seconds=N``, default all)."""
        try:
            seconds = int(request.query["seconds"]) if "seconds" in request.query else None
        except ValueError:
            return web.json_response({"error": "seconds must be an integer"}, status=400)
        return web.json_response(
            {
                "tier": self.metrics.tier,
                "name": self.name,
                "interval_s": self._sampler.interval_s,
                "points": self.series.json(seconds),
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        """The registry in the format the scraper's ``Accept`` asks for."""
        body, content_type = exposition(self.metrics.registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})


