"""OpenTelemetry tracing: one trace per request across every tier.

``setup_tracing(service_name)`` builds a ``Telemetry`` that owns its own
``TracerProvider`` (never the process-global one) and propagator, configured
from the standard OTel environment variables (``common.observability.otel_env``
reads and validates the ones that choose objects; the SDK objects read the rest):

* ``OTEL_SDK_DISABLED=true``: no provider at all, a no-op tracer;
* ``OTEL_SERVICE_NAME`` (and ``OTEL_RESOURCE_ATTRIBUTES``) name the resource;
  ``service_name`` is the fallback when the variable is unset;
* ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` choose the sampler;
  Meridian's default (variable unset) is ``parentbased_traceidratio`` at 0.1: a
  caller's sampled trace is always followed, and 1 in 10 of the other requests
  is traced: tracing's own code then costs ~1 % of a saturated tier's CPU per
  request, tracing every request 11-20 % (``bench/results/tracing_overhead.md``);
* ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``) and
  ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (``grpc``, ``http/protobuf``): where
  finished spans are batched to; each OTLP exporter reads its endpoint, headers,
  TLS and timeout variables itself. Whatever the exporters, the newest spans
  stay in a bounded in-memory ring (``RecentSpans``) for ``/api/traces``;
* ``OTEL_PROPAGATORS`` (``tracecontext``, ``baggage``, ``b3``, ``b3multi``):
  how context crosses tiers in gRPC metadata. ``extract_context`` reads the
  caller's, ``inject_context`` writes this tier's own span (and the caller's
  baggage) so the next tier's spans nest under it.

Span and attribute names: ``common.observability.trace_names``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TextIO

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status
from opentelemetry.trace import StatusCode as SpanStatus
from opentelemetry.util.types import AttributeValue

from common.basics.vocabulary import ANONYMOUS_TENANT
from common.observability.otel_env import (
    DEFAULT_PROPAGATORS,
    PROPAGATORS,
    TraceSettings,
    build_propagator,
    trace_settings,
)
from common.observability.recent_spans import RECENT_SPANS, RecentSpans
from common.observability.trace_names import (
    ACTUAL_S,
    ATTEMPT,
    CACHED_BLOCKS,
    CANDIDATES,
    CHILD,
    ESTIMATED_S,
    GPU,
    INPUT_TOKENS,
    MAX_TOKENS,
    MODEL,
    OUTPUT_TOKENS,
    POLICY,
    REASON,
    REGION,
    STATUS,
    STATUS_NAME,
    TENANT,
    TIER,
    USAGE_ESTIMATED,
    ZONE,
    route_attributes,
    rpc_attributes,
    span_name,
    usage_attributes,
)
from common.observability.unsampled import inject_unsampled, skips_unsampled, unsampled_parent
from common.request.balancer import Lease
from common.request.call import INFER_METHODS, CallRecord

__all__ = [
    "ACTUAL_S",
    "ATTEMPT",
    "CACHED_BLOCKS",
    "CANDIDATES",
    "CHILD",
    "ESTIMATED_S",
    "GPU",
    "INPUT_TOKENS",
    "MAX_TOKENS",
    "MODEL",
    "OUTPUT_TOKENS",
    "POLICY",
    "REASON",
    "REGION",
    "STATUS",
    "STATUS_NAME",
    "TENANT",
    "TIER",
    "USAGE_ESTIMATED",
    "ZONE",
    "RecentSpans",
    "Telemetry",
    "TierTracing",
    "end_span",
    "extract_context",
    "inject_context",
    "route_attributes",
    "setup_tracing",
    "span_name",
]

DEFAULT_PROPAGATOR = build_propagator(DEFAULT_PROPAGATORS)
# Every metadata key a known propagator reads or writes (B3's single-header format
# also reads the multi-header keys): taken off what goes down, then written anew.
TRACE_HEADERS = frozenset(key for make in PROPAGATORS.values() for key in make().fields) | {
    "x-b3-parentspanid"
}


@dataclass
class Telemetry:
    """A tracer, the provider behind it and the propagator to use with it, owned by one
    process (or one test)."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None
    recent: RecentSpans | None = None
    exporting: bool = False
    propagator: TextMapPropagator = DEFAULT_PROPAGATOR
    _shut: bool = field(default=False, repr=False)

    def shutdown(self) -> None:
        """Flush and stop exporting (the last step of a tier's shutdown)."""
        if self.provider is not None and not self._shut:
            self._shut = True
            self.provider.shutdown()


DEFAULT_SAMPLE_RATIO = 0.1


def span_exporter(name: str, protocol: str, out: TextIO) -> SpanExporter:
    """One exporter of ``OTEL_TRACES_EXPORTER`` (the OTLP ones read their own variables)."""
    if name == "console":
        return ConsoleSpanExporter(out=out)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def setup_tracing(
    service_name: str,
    *,
    capacity: int = RECENT_SPANS,
    out: TextIO | None = None,
) -> Telemetry:
    """A ``Telemetry`` for one service, configured from the OTel env vars (read once, here
    and by the SDK objects built here; never on the request path). ``out`` is where the
    console exporter writes (standard output by default). A variable with a value
    Meridian does not know raises ConfigError naming it."""
    env = os.environ
    settings: TraceSettings = trace_settings(env)
    if settings.disabled:
        return Telemetry(trace.NoOpTracer())
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    # Resource.create and the provider's default sampler read the OTel env vars themselves;
    # without one, trace 1 in 10 requests (and every request a caller sampled).
    sampler = None if settings.sampler else ParentBased(TraceIdRatioBased(DEFAULT_SAMPLE_RATIO))
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    for name in settings.exporters:
        exporter = span_exporter(name, settings.protocol, out or sys.stdout)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    recent = RecentSpans(capacity)
    provider.add_span_processor(recent)
    return Telemetry(
        provider.get_tracer("meridian"),
        provider,
        recent,
        exporting=bool(settings.exporters),
        propagator=build_propagator(settings.propagators),
    )


def extract_context(
    metadata: Iterable[tuple[str, str | bytes]],
    propagator: TextMapPropagator = DEFAULT_PROPAGATOR,
) -> Context | None:
    """The caller's trace context (and baggage) from gRPC metadata (None if it has none)."""
    carrier = {k: v for k, v in metadata if k in TRACE_HEADERS and isinstance(v, str)}
    if not carrier:
        return None
    return propagator.extract(carrier)


def inject_context(
    metadata: list[tuple[str, str]],
    span: trace.Span | None,
    propagator: TextMapPropagator = DEFAULT_PROPAGATOR,
) -> list[tuple[str, str]]:
    """``metadata`` with its trace keys replaced by ``span``'s context, so the tier below
    nests under it; the caller's baggage, passed down in ``metadata``, is written anew
    when the propagator carries baggage. An invalid span leaves the keys as they came."""
    if span is None or not span.get_span_context().is_valid:
        return metadata
    base = None
    if any(k == "baggage" for k, _ in metadata):
        base = propagator.extract({k: v for k, v in metadata if k == "baggage"})
    carrier: dict[str, str] = {}
    propagator.inject(carrier, trace.set_span_in_context(span, base))
    kept = [(k, v) for k, v in metadata if k not in TRACE_HEADERS]
    kept.extend(carrier.items())
    return kept


def hex_trace_id(span: trace.Span | None) -> str:
    if span is None:
        return ""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


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
    attributes[STATUS_NAME] = code.name
    span.set_attributes(attributes)
    if code != grpc.StatusCode.OK:
        span.set_status(Status(SpanStatus.ERROR, f"{code.name}: {detail}" if detail else code.name))
    span.end()


class TierTracing:
    """The spans of one tier's calls: a server span per call (continuing the caller's
    trace; as a ``CallObserver`` of the call interceptor), and, for the forwarding loop
    (``AttemptTracing``), a ``pick`` span per decision with a ``queue`` span for time
    in the local queue, and a client span per forward attempt (kept in the lease's
    ``span`` until the loop settles the attempt), whose context goes down to the child
    through ``propagator``.

    Cheap on the request path: with a no-op tracer (or a sampled-out request) every
    method returns at its first line, and a server span starts with attributes built
    once per method (``serve_at``), so a request the sampler drops builds none; a
    decision span is recorded after the fact from its start time, with all its
    attributes at once; attributes are set in one call. A request whose caller's
    ``traceparent`` says "not sampled" gets no span at all under a parent-based
    sampler, and a dropped span's context goes down as one formatted header
    (``common.observability.unsampled``).
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        tier: str,
        propagator: TextMapPropagator = DEFAULT_PROPAGATOR,
    ) -> None:
        self.tracer = tracer
        self.tier = tier
        self.propagator = propagator
        self.enabled = not isinstance(tracer, trace.NoOpTracer)
        # A caller's unsampled traceparent settles it: no span (common.observability.unsampled).
        self._skip_unsampled = self.enabled and skips_unsampled(tracer, propagator)
        self._w3c_only = set(propagator.fields) <= {"traceparent", "tracestate", "baggage"}
        self.serve_at("", 0)

    def serve_at(self, host: str, port: int) -> None:
        """The address this tier serves (known once its server is bound)."""
        self._server_attributes: dict[str, dict[str, AttributeValue]] = {
            method: {TIER: self.tier, **rpc_attributes(method, host, port)}
            for method in INFER_METHODS
        }

    def server_span(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> Span:
        if not self.enabled or (self._skip_unsampled and unsampled_parent(metadata or ())):
            return trace.INVALID_SPAN
        attributes = self._server_attributes.get(method) or {TIER: self.tier}
        return self.tracer.start_span(
            span_name(method),
            context=extract_context(metadata or (), self.propagator),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )

    def call_started(self, call: CallRecord) -> None:
        call.span = self.server_span(call.method, call.metadata)

    def call_ended(self, call: CallRecord) -> None:
        span = call.span
        if not span.is_recording():
            return
        attributes = usage_attributes(call)
        attributes.update(route_attributes(call.route))
        # Without authentication every caller is the anonymous tenant.
        attributes[TENANT] = call.tenant or ANONYMOUS_TENANT
        end_span(span, call.code, attributes=attributes)

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
            if lease.cached_blocks:
                attributes[CACHED_BLOCKS] = lease.cached_blocks
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
        endpoint = lease.child.endpoint
        attributes: dict[str, AttributeValue] = {
            **rpc_attributes(method, endpoint.host, endpoint.port),
            CHILD: lease.child.name,
            ATTEMPT: attempt,
        }
        if lease.estimated_s is not None:
            attributes[ESTIMATED_S] = lease.estimated_s
        lease.span = self.tracer.start_span(
            span_name(method),
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )

    @staticmethod
    def end_attempt(lease: Lease, code: grpc.StatusCode, detail: str, elapsed: float) -> None:
        span, lease.span = lease.span, None
        if span is not None:
            end_span(span, code, detail, {ACTUAL_S: elapsed})

    def child_metadata(
        self, metadata: list[tuple[str, str]], lease: Lease, parent: Span
    ) -> list[tuple[str, str]]:
        """Downstream metadata carrying this tier's context: the attempt span's, or
        (sampled out) the server span's, so the tiers below keep the sampling decision."""
        span = lease.span or parent
        if self._w3c_only and not span.is_recording() and span.get_span_context().is_valid:
            return inject_unsampled(metadata, span)
        return inject_context(metadata, span, self.propagator)
