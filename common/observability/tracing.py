"""OpenTelemetry tracing: one trace per request across every tier.

``setup_tracing(service_name)`` builds a ``Telemetry`` that owns its own
``TracerProvider`` (never the process-global one), configured from the
standard OTel environment variables through the SDK's own handling:

* ``OTEL_SDK_DISABLED=true``: no provider at all, a no-op tracer;
* ``OTEL_SERVICE_NAME`` (and ``OTEL_RESOURCE_ATTRIBUTES``) name the resource;
  ``service_name`` is the fallback when the variable is unset;
* ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` choose the sampler;
  Meridian's default (variable unset) is ``parentbased_traceidratio`` at 0.1: a
  caller's sampled ``traceparent`` is always followed, and 1 in 10 of the other
  requests is traced, which keeps tracing under 10 % of a saturated tier's
  throughput (``bench/results/tracing_overhead.md``);
* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``):
  spans are batched to that OTLP/gRPC collector; without one, finished spans
  are kept in a bounded in-memory ring (``RecentSpans``) for ``/api/traces``.

Context crosses tiers as W3C ``traceparent``/``tracestate`` in gRPC metadata:
``extract_context`` reads the caller's, ``inject_context`` writes this tier's
own span so the next tier's spans nest under it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status
from opentelemetry.trace import StatusCode as SpanStatus
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from common.basics.vocabulary import ANONYMOUS_TENANT
from common.request.balancer import Lease

RECENT_SPANS = 2000
TRACE_KEYS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()

# Span attribute names (OTel semantic conventions where one exists).
TIER = "meridian.tier"
REGION = "meridian.region"
ZONE = "meridian.zone"
GPU = "meridian.gpu"
POLICY = "meridian.policy"
REASON = "meridian.decision.reason"
CANDIDATES = "meridian.candidates"
ESTIMATED_S = "meridian.estimated_s"
ACTUAL_S = "meridian.actual_s"
TENANT = "meridian.tenant"
MODEL = "gen_ai.request.model"
ATTEMPT = "meridian.attempt"
CHILD = "meridian.child"
STATUS = "rpc.grpc.status_code"


class RecentSpans(SpanProcessor):
    """The newest ``capacity`` finished spans, oldest dropped first.

    ``on_end`` runs on the request path, so it only appends to a bounded deque
    (O(1), no export work); grouping happens when someone reads ``traces()``.
    """

    def __init__(self, capacity: int = RECENT_SPANS) -> None:
        self._spans: deque[ReadableSpan] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self._spans.append(span)

    def spans(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    def traces(self) -> dict[str, list[ReadableSpan]]:
        """Spans grouped by hex trace id, each trace's spans in start order."""
        grouped: dict[str, list[ReadableSpan]] = {}
        for span in self.spans():
            ctx = span.get_span_context()
            if ctx is None:
                continue
            grouped.setdefault(format(ctx.trace_id, "032x"), []).append(span)
        for spans in grouped.values():
            spans.sort(key=lambda s: s.start_time or 0)
        return grouped

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()


@dataclass
class Telemetry:
    """A tracer and the provider behind it, owned by one process (or one test)."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None
    recent: RecentSpans | None = None
    exporting: bool = False
    _shut: bool = field(default=False, repr=False)

    def shutdown(self) -> None:
        """Flush and stop exporting (the last step of a tier's shutdown)."""
        if self.provider is not None and not self._shut:
            self._shut = True
            self.provider.shutdown()


DEFAULT_SAMPLE_RATIO = 0.1


def setup_tracing(service_name: str, *, capacity: int = RECENT_SPANS) -> Telemetry:
    """A ``Telemetry`` for one service, configured from the OTel env vars (read once, here
    and by the SDK objects built here; never on the request path)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Telemetry(trace.NoOpTracer())
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    # Resource.create and the provider's default sampler read the OTel env vars themselves;
    # without one, trace 1 in 10 requests (and every request a caller sampled).
    sampler = None
    if not env.get("OTEL_TRACES_SAMPLER"):
        sampler = ParentBased(TraceIdRatioBased(DEFAULT_SAMPLE_RATIO))
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    recent: RecentSpans | None = None
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # The exporter reads the endpoint, headers, TLS and timeout variables itself.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        recent = RecentSpans(capacity)
        provider.add_span_processor(recent)
    tracer = provider.get_tracer("meridian")
    return Telemetry(tracer, provider, recent, exporting=bool(endpoint))


def extract_context(metadata: Iterable[tuple[str, str | bytes]]) -> Context | None:
    """The caller's trace context from W3C keys in gRPC metadata (None if absent)."""
    carrier = {k: v for k, v in metadata if k in TRACE_KEYS and isinstance(v, str)}
    if not carrier:
        return None
    return _PROPAGATOR.extract(carrier)


def inject_context(
    metadata: list[tuple[str, str]], span: trace.Span | None
) -> list[tuple[str, str]]:
    """``metadata`` with its W3C keys replaced by ``span``'s context, so the tier below
    nests under it. A non-recording or invalid span leaves the keys as they came."""
    if span is None or not span.get_span_context().is_valid:
        return metadata
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    kept = [(k, v) for k, v in metadata if k not in TRACE_KEYS]
    kept.extend(carrier.items())
    return kept


def hex_trace_id(span: trace.Span | None) -> str:
    if span is None:
        return ""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def route_attributes(route: str) -> dict[str, str]:
    """``meridian.region/zone/gpu`` from an ``x-meridian-route`` (``region/zone/gpu``,
    read from the right: a local tier's route has no region)."""
    parts = route.split("/") if route else []
    names = (GPU, ZONE, REGION)
    return {name: part for name, part in zip(names, reversed(parts), strict=False)}


def end_span(
    span: trace.Span,
    code: grpc.StatusCode,
    detail: str = "",
    attributes: dict[str, AttributeValue] | None = None,
) -> None:
    """End ``span`` with a call's gRPC status (an error status unless OK), adding
    ``attributes`` in the same call (each SDK attribute call takes a lock)."""
    attributes = {} if attributes is None else attributes
    attributes[STATUS] = code.value[0]
    span.set_attributes(attributes)
    if code != grpc.StatusCode.OK:
        span.set_status(Status(SpanStatus.ERROR, f"{code.name}: {detail}" if detail else code.name))
    span.end()


class TierTracing:
    """The spans one tier's proxy makes for a call: a server span (continuing the
    caller's trace), a ``pick`` span per decision with a ``queue`` span for time in
    the local queue, and a client span per forward attempt (kept in the lease's
    ``span`` until the proxy settles the attempt).

    Cheap on the request path: with a no-op tracer (or a sampled-out request) every
    method returns at its first line; a decision span is recorded after the fact from
    its start time, with all its attributes at once; attributes are set in one call.
    """

    def __init__(self, tracer: trace.Tracer, tier: str) -> None:
        self.tracer = tracer
        self.tier = tier
        self.enabled = not isinstance(tracer, trace.NoOpTracer)

    def server_span(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> Span:
        if not self.enabled:
            return trace.INVALID_SPAN
        return self.tracer.start_span(
            method,
            context=extract_context(metadata or ()),
            kind=SpanKind.SERVER,
            attributes={TIER: self.tier},
        )

    def end_server_span(
        self, span: Span, tenant: str | None, model: str, route: str, code: grpc.StatusCode
    ) -> None:
        if not span.is_recording():
            return
        attributes: dict[str, AttributeValue] = dict(route_attributes(route))
        if model:
            attributes[MODEL] = model
        # Without authentication every caller is the anonymous tenant (common.tenancy.auth).
        attributes[TENANT] = tenant or ANONYMOUS_TENANT
        end_span(span, code, attributes=attributes)

    @staticmethod
    def decision_started(parent: Span) -> int:
        """When a decision under ``parent`` started (0: not traced)."""
        return time.time_ns() if parent.is_recording() else 0

    def record_decision(
        self,
        parent: Span,
        started: int,
        lease: Lease | None = None,
        code: grpc.StatusCode = grpc.StatusCode.OK,
    ) -> None:
        """The ``pick`` span from ``started`` to now: the lease it produced, or the
        status it failed with; a ``queue`` child span for time spent in the queue."""
        if not started:
            return
        # Tier and model are on the server span above; a child span carries only its own.
        attributes: dict[str, AttributeValue] = {}
        if lease is not None:
            attributes[CHILD] = lease.child.name
            attributes[REASON] = lease.reason
            attributes[CANDIDATES] = lease.candidates
            if lease.estimated_s is not None:
                attributes[ESTIMATED_S] = lease.estimated_s
            if lease.policy:
                attributes[POLICY] = lease.policy
        span = self.tracer.start_span(
            "pick",
            context=trace.set_span_in_context(parent),
            start_time=started,
            attributes=attributes,
        )
        end = time.time_ns()
        queued_s = lease.queued_s if lease is not None else None
        if queued_s is not None and lease is not None:
            # The wait in the local queue ended just now; its span is rebuilt from its length.
            queue = self.tracer.start_span(
                "queue",
                context=trace.set_span_in_context(span),
                start_time=max(started, end - int(queued_s * 1e9)),
                attributes={CHILD: lease.child.name},
            )
            queue.end(end_time=end)
        if code != grpc.StatusCode.OK:
            span.set_status(Status(SpanStatus.ERROR, code.name))
        span.end(end_time=end)

    def begin_attempt(self, method: str, lease: Lease, attempt: int, parent: Span) -> None:
        """A client span for one forward attempt; the proxy's ``settle`` ends it."""
        if not parent.is_recording():
            return
        attributes: dict[str, AttributeValue] = {CHILD: lease.child.name, ATTEMPT: attempt}
        if lease.estimated_s is not None:
            attributes[ESTIMATED_S] = lease.estimated_s
        lease.span = self.tracer.start_span(
            f"{method} {lease.child.name}",
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )

