"""A tier's metric definitions: request metrics (a gRPC server interceptor), child
health and summary age (callback gauges), retries, the local tier's queue and ejections.

``TierMetrics`` owns a tier's ``Registry`` and its families. Request counts and
latencies are recorded when the call interceptor (``common.request.call``) tells it
a request ended — a ModelInfer call, or one request of a ModelStreamInfer (each
counted on its own) — so the request path stays free of metric calls; streams
themselves are counted apart, by how they ended. Child health and summary age
are callback gauges read from the ``ChildSet`` at scrape time.

Labels are bounded: ``model`` is a configured model or ``-``, ``tenant`` a
configured tenant id or ``-``, ``status`` a gRPC status code name.
"""


from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable

import grpc

from common.observability.metrics import (
    CallbackCounter,
    CallbackGauge,
    CounterChild,
    Registry,
)
from common.request.call import CallRecord
from common.request.children import ChildSet
from common.request.resilience import RetryBudget, RetryBudgetConfig

UNKNOWN_LABEL = "-"



def shed_reason(message: str) -> str:
    """A bounded reason for a RESOURCE_EXHAUSTED answer, from its message."""
    for limit in (
        "requests_per_s",
        "tokens_per_min",
        "max_concurrent",
        "max_open_streams_per_tenant",
    ):
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
    ) -> None:
        self.tier = tier
        self.children = children
        self.models = frozenset(models)
        self.tenants = frozenset(tenants)
        self.registry = Registry()
        r = self.registry
        self.requests = r.counter(
            "meridian_requests_total",
            "Inference requests answered by this tier (a ModelInfer call, or one "
            "request of a stream), by final gRPC status.",
            ("tier", "model", "status", "tenant"),
        )
        self.streams = r.counter(
            "meridian_streams_total",
            "ModelStreamInfer calls ended at this tier, by final gRPC status "
            "(their requests are counted in meridian_requests_total).",
            ("tier", "status", "tenant"),
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

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self.tenants else UNKNOWN_LABEL

    def record(
        self, model: str, tenant: str, code: grpc.StatusCode, detail: str, seconds: float
    ) -> None:
        model = self.model_label(model)
        status = code.name
        self.requests.labels(self.tier, model, status, tenant).inc()
        self.duration.labels(self.tier, model, status).observe(seconds)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.sheds.labels(self.tier, shed_reason(detail)).inc()

    # As a CallObserver of the call interceptor (common.request.call): the tenant is
    # the one the proxy resolved, so it is right at the edge too.
    def call_started(self, call: CallRecord) -> None:
        return None

    def call_ended(self, call: CallRecord) -> None:
        tenant = self.tenant_label(call.tenant)
        if call.carries_requests:
            self.streams.labels(self.tier, call.code.name, tenant).inc()
            # A stream refused as a whole (its requests' refusals count as they end).
            if call.code is grpc.StatusCode.RESOURCE_EXHAUSTED and not call.requests:
                self.sheds.labels(self.tier, shed_reason(call.detail)).inc()
            return
        self.record(call.model, tenant, call.code, call.detail, call.elapsed_s)


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
