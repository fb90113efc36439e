"""Operations surface of a tier: request metrics (a gRPC server interceptor) and the ops HTTP.

``TierMetrics`` owns a tier's ``Registry`` and its families. Request counts and
latencies are recorded by ``MetricsInterceptor``, a grpc.aio server interceptor
around ModelInfer and ModelStreamInfer, so the request path (``common.proxy``)
stays free of metric calls. Child health and summary age are callback gauges
read from the ``ChildSet`` at scrape time.

``OpsServer`` serves, over plain HTTP (aiohttp) on the tier's ``ops_listen``:

* ``/healthz``: 200 while the process runs (liveness);
* ``/readyz``: 200 while some child is healthy (``children.any_healthy()``), else 503
  (also 503 once the tier has begun to stop);
* ``/api/state``: JSON view of the tier and its children;
* ``/metrics``: Prometheus text exposition 0.0.4;
* ``/api/traces``: this tier's recent traces (``?limit=N``, ``?ids=a,b`` for given ones);
* ``/api/series``: requests per second and latency per second, last five minutes
  (``common.series``).

A tier may add its own routes (``extensions``: the global tier's dashboard) and
details per child or for the whole tier (``child_details``, ``extra_state``).

Labels are bounded: ``model`` is a configured model or ``-``, ``tenant`` a
configured tenant id or ``-`` (the tenant is read from the internal
``x-meridian-tenant`` metadata, believed only on tiers that trust the tier
above; the edge resolves the tenant inside the proxy, after the interceptor,
so the global tier reports ``-``), ``status`` a gRPC status code name.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict
from opentelemetry.sdk.trace import ReadableSpan

from common.children import Child, ChildSet
from common.config import Endpoint
from common.metrics import CONTENT_TYPE, CallbackCounter, CallbackGauge, CounterChild, Registry
from common.resilience import RetryBudget, RetryBudgetConfig
from common.routing import TENANT
from common.series import RequestSeries
from common.telemetry import RecentSpans
from common.ticker import Ticker

INFER_METHODS = frozenset({"ModelInfer", "ModelStreamInfer"})
UNKNOWN_LABEL = "-"


def shed_reason(message: str) -> str:
    """A bounded reason for a RESOURCE_EXHAUSTED answer, from its message."""
    for limit in ("requests_per_s", "tokens_per_min", "max_concurrent"):
        if limit in message:
            return limit
    return "capacity"


class TierMetrics:
    """The metric families of one tier process and the readers of its children."""

    def __init__(
        self,
        tier: str,
        children: ChildSet,
        *,
        models: Collection[str] = (),
        tenants: Collection[str] = (),
        trust_tenant: bool = False,
    ) -> None:
        self.tier = tier
        self.children = children
        self.models = frozenset(models)
        self.tenants = frozenset(tenants)
        self.trust_tenant = trust_tenant
        self.registry = Registry()
        r = self.registry
        self.requests = r.counter(
            "meridian_requests_total",
            "Inference calls answered by this tier, by final gRPC status.",
            ("tier", "model", "status", "tenant"),
        )
        self.duration = r.histogram(
            "meridian_request_duration_seconds",
            "Time from receiving an inference call to its last response.",
            ("tier", "model", "status"),
        )
        self.retries = r.counter(
            "meridian_retries_total",
            "Retries to another live child that took a slot of the retry budget "
            "(failovers away from a child found down are not retries).",
            ("tier",),
        )
        self.sheds = r.counter(
            "meridian_sheds_total",
            "Calls refused with RESOURCE_EXHAUSTED (tenant limit or no capacity).",
            ("tier", "reason"),
        )
        r.register(
            CallbackGauge(
                "meridian_child_healthy",
                "1 while direct evidence says the child is up, else 0.",
                ("tier", "child"),
                self._child_health,
            )
        )
        r.register(
            CallbackGauge(
                "meridian_child_summary_age_seconds",
                "Age of the child's newest capacity summary; NaN when none arrived.",
                ("tier", "child"),
                self._summary_ages,
            )
        )

    def _child_health(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for child in self.children:
            yield (self.tier, child.name), 1.0 if child.healthy else 0.0

    def _summary_ages(self) -> Iterable[tuple[tuple[str, ...], float]]:
        now = self.children.clock()
        for child in self.children:
            age = math.nan if child.summary is None else now - child.summary_received_at
            yield (self.tier, child.name), age

    def model_label(self, model: str) -> str:
        return model if model in self.models else UNKNOWN_LABEL

    def tenant_label(self, metadata: Iterable[tuple[str, Any]] | None) -> str:
        if not self.trust_tenant or metadata is None:
            return UNKNOWN_LABEL
        for key, value in metadata:
            if key == TENANT:
                return value if value in self.tenants else UNKNOWN_LABEL
        return UNKNOWN_LABEL

    def record(
        self, model: str, tenant: str, code: grpc.StatusCode, detail: str, seconds: float
    ) -> None:
        model = self.model_label(model)
        status = code.name
        self.requests.labels(self.tier, model, status, tenant).inc()
        self.duration.labels(self.tier, model, status).observe(seconds)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.sheds.labels(self.tier, shed_reason(detail)).inc()

    def interceptor(self) -> MetricsInterceptor:
        return MetricsInterceptor(self)


def _final_status(context: Any, exc: BaseException | None) -> tuple[grpc.StatusCode, str]:
    """The status a handler ended with: what ``context`` says, else OK / CANCELLED / UNKNOWN."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code, context.details() or ""
    if isinstance(code, int):
        for member in grpc.StatusCode:
            if member.value[0] == code:
                return member, context.details() or ""
    if exc is None:
        return grpc.StatusCode.OK, ""
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, ""
    return grpc.StatusCode.UNKNOWN, str(exc)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times ModelInfer and ModelStreamInfer; other methods pass untouched."""

    def __init__(self, metrics: TierMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rpartition("/")[2]
        if handler is None or method not in INFER_METHODS:
            return handler
        tenant = self.metrics.tenant_label(handler_call_details.invocation_metadata)
        record = self.metrics.record
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def timed_unary(request: Any, context: Any) -> Any:
                started = time.perf_counter()
                failure: BaseException | None = None
                try:
                    return await unary(request, context)
                except BaseException as exc:
                    failure = exc
                    raise
                finally:
                    code, detail = _final_status(context, failure)
                    record(request.model_name, tenant, code, detail, time.perf_counter() - started)

            return grpc.unary_unary_rpc_method_handler(
                timed_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            stream = handler.stream_stream

            async def timed_stream(request_iterator: AsyncIterator[Any], context: Any) -> Any:
                started = time.perf_counter()
                model = [""]

                async def watched() -> AsyncIterator[Any]:
                    async for request in request_iterator:
                        if not model[0]:
                            model[0] = request.model_name
                        yield request

                failure: BaseException | None = None
                try:
                    return await stream(watched(), context)
                except BaseException as exc:
                    failure = exc
                    raise
                finally:
                    code, detail = _final_status(context, failure)
                    record(model[0], tenant, code, detail, time.perf_counter() - started)

            return grpc.stream_stream_rpc_method_handler(
                timed_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


ChildDetails = Callable[[Child], dict[str, Any]]


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
    ``stop()`` closes the listener and the runner.
    """

    def __init__(self, endpoint: Endpoint, name: str, metrics: TierMetrics) -> None:
        self.endpoint = endpoint
        self.name = name
        self.metrics = metrics
        self.children = metrics.children
        self.port = endpoint.port
        # Set when the tier begins to stop: /readyz answers 503 from then on.
        self.draining = False
        # The tier's recent finished spans (None when traces are exported instead).
        self.recent: RecentSpans | None = None
        self.series = RequestSeries(metrics.requests, metrics.duration)
        self._sampler = Ticker(self.series.sample, 1.0)
        # What a tier adds: routes (each called with the app), per-child and tier-wide state.
        self.extensions: list[Callable[[web.Application], None]] = []
        self.child_details: ChildDetails | None = None
        self.extra_state: Callable[[], dict[str, Any]] | None = None
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return Endpoint(self.endpoint.host, self.port).address

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/traces", self._traces)
        app.router.add_get("/api/series", self._series)
        for extend in self.extensions:
            extend(app)
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
        return web.Response(
            body=self.metrics.registry.render().encode(), headers={"Content-Type": CONTENT_TYPE}
        )


class CountingRetryBudget(RetryBudget):
    """A retry budget that counts the retries it lets start (``TierServer`` gives one
    to its proxy, so the request path needs no metric call)."""

    def __init__(self, counter: CounterChild, config: RetryBudgetConfig | None = None) -> None:
        super().__init__(config)
        self.counter = counter

    def try_start_retry(self) -> bool:
        started = super().try_start_retry()
        if started:
            self.counter.inc()
        return started


class EjectionCounter:
    """Counts outlier ejections by polling the ejected set (``poll()`` on a ticker).

    An ejection lasts at least the base ejection time (30 s), far longer than the
    poll interval, so none is missed; a child re-ejected within one poll of its
    return would be counted once.
    """

    def __init__(self, ejected_keys: Callable[[], frozenset[str]]) -> None:
        self.ejected_keys = ejected_keys
        self.total = 0
        self._seen: frozenset[str] = frozenset()

    def poll(self) -> None:
        now = self.ejected_keys()
        self.total += len(now - self._seen)
        self._seen = now


def add_local_metrics(
    metrics: TierMetrics,
    depth_by_priority: Callable[[], dict[str, int]],
    ejections: EjectionCounter,
) -> None:
    """The local tier's own families: central queue depth and outlier ejections."""
    metrics.registry.register(
        CallbackGauge(
            "meridian_queue_depth",
            "Requests waiting in the local tier's central queue, by priority.",
            ("priority",),
            lambda: (((p,), float(n)) for p, n in depth_by_priority().items()),
        )
    )
    metrics.registry.register(
        CallbackCounter(
            "meridian_ejections_total",
            "GPUs ejected by outlier detection since the process started.",
            (),
            lambda: [((), float(ejections.total))],
        )
    )
