"""A tier's metric definitions: request metrics (a gRPC server interceptor), child
health and summary age (callback gauges), retries, the local tier's queue and ejections.

``TierMetrics`` owns a tier's ``Registry`` and its families. Request counts and
latencies are recorded by ``MetricsInterceptor``, a grpc.aio server interceptor
around ModelInfer and ModelStreamInfer, so the request path stays free of metric
calls. Child health and summary age are callback gauges read from the ``ChildSet``
at scrape time.

Labels are bounded: ``model`` is a configured model or ``-``, ``tenant`` a
configured tenant id or ``-``, ``status`` a gRPC status code name.
"""


from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from typing import Any

import grpc

from common.observability.metrics import (
    CallbackCounter,
    CallbackGauge,
    CounterChild,
    Registry,
)
from common.request.children import ChildSet
from common.request.resilience import RetryBudget, RetryBudgetConfig
from common.request.routing import TENANT

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
