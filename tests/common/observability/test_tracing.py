"""Tracing set-up: the span ring, W3C context in metadata, the OTel env vars."""

from __future__ import annotations

import os

import grpc
import pytest
from opentelemetry import trace

from common.observability import tracing as tm

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the OTel variables it is about; none leak in from outside."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    # Record every span unless a test says otherwise (Meridian's default samples 1 in 10).
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")


def test_default_sampler_traces_one_in_ten_and_follows_sampled_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    telemetry = tm.setup_tracing("meridian-test")
    for _ in range(2000):
        telemetry.tracer.start_span("request").end()
    assert telemetry.recent is not None
    kept = sum(len(spans) for spans in telemetry.recent.traces().values())
    assert 100 <= kept <= 300  # ~10 % of 2000


def test_ring_keeps_only_the_newest_spans() -> None:
    telemetry = tm.setup_tracing("svc", capacity=5)
    assert telemetry.recent is not None
    for i in range(12):
        telemetry.tracer.start_span(f"s{i}").end()
    names = [s.name for s in telemetry.recent.spans()]
    assert names == [f"s{i}" for i in range(7, 12)]
    telemetry.shutdown()


def test_traces_group_spans_by_trace_id() -> None:
    telemetry = tm.setup_tracing("svc")
    assert telemetry.recent is not None
    for _ in range(3):
        root = telemetry.tracer.start_span("root")
        telemetry.tracer.start_span("child", context=trace.set_span_in_context(root)).end()
        root.end()
    traces = telemetry.recent.traces()
    assert len(traces) == 3
    for trace_id, spans in traces.items():
        assert [s.name for s in spans] == ["root", "child"]
        assert all(format(s.context.trace_id, "032x") == trace_id for s in spans)


def test_traceparent_extracted_and_injected_round_trip() -> None:
    telemetry = tm.setup_tracing("svc")
    parent = tm.extract_context([("traceparent", TRACEPARENT), ("x-other", "1")])
    span = telemetry.tracer.start_span("server", context=parent)
    assert format(span.get_span_context().trace_id, "032x") == TRACE
    metadata = tm.inject_context([("traceparent", TRACEPARENT), ("x-meridian-attempt", "0")], span)
    keys = [k for k, _ in metadata]
    assert keys.count("traceparent") == 1 and "x-meridian-attempt" in keys
    sent = dict(metadata)["traceparent"]
    assert sent == f"00-{TRACE}-{format(span.get_span_context().span_id, '016x')}-01"
    # The tier below continues it: same trace, this span as parent.
    below = telemetry.tracer.start_span("below", context=tm.extract_context(metadata))
    assert below.parent is not None
    assert below.parent.span_id == span.get_span_context().span_id


def test_no_traceparent_means_no_parent_context() -> None:
    assert tm.extract_context([("x-meridian-session", "s")]) is None


def test_untraced_metadata_passes_through_unchanged() -> None:
    metadata = [("traceparent", TRACEPARENT)]
    assert tm.inject_context(metadata, None) == metadata
    assert tm.inject_context(metadata, trace.INVALID_SPAN) == metadata


def test_service_name_defaults_to_the_argument() -> None:
    telemetry = tm.setup_tracing("meridian-local")
    assert telemetry.provider is not None
    assert telemetry.provider.resource.attributes["service.name"] == "meridian-local"


def test_otel_service_name_sets_the_resource(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-eu")
    telemetry = tm.setup_tracing("meridian-global")
    assert telemetry.provider is not None
    assert telemetry.provider.resource.attributes["service.name"] == "edge-eu"


def test_sampler_always_off_records_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    telemetry = tm.setup_tracing("svc")
    assert telemetry.recent is not None
    span = telemetry.tracer.start_span("dropped")
    assert not span.is_recording()
    span.end()
    assert telemetry.recent.spans() == []


def test_sampler_ratio_arg_honoured(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    telemetry = tm.setup_tracing("svc")
    telemetry.tracer.start_span("dropped").end()
    assert telemetry.recent is not None and telemetry.recent.spans() == []


def test_sdk_disabled_gives_a_no_op_tracer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    telemetry = tm.setup_tracing("svc")
    assert telemetry.provider is None and telemetry.recent is None
    assert isinstance(telemetry.tracer, trace.NoOpTracer)
    assert not tm.TierTracing(telemetry.tracer, "local").enabled
    telemetry.shutdown()  # nothing to flush, no error


def test_otlp_endpoint_exports_and_still_keeps_recent_spans(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Nothing listens there: the batch exporter only tries when flushed.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    telemetry = tm.setup_tracing("svc")
    # /api/traces (and the dashboard) keep working while spans go to a collector.
    assert telemetry.exporting and telemetry.recent is not None
    telemetry.shutdown()


def test_provider_is_not_the_global_one() -> None:
    telemetry = tm.setup_tracing("svc")
    assert trace.get_tracer_provider() is not telemetry.provider


def test_route_attributes_read_from_the_right() -> None:
    assert tm.route_attributes("eu/eu-1a/g3") == {
        tm.REGION: "eu",
        tm.ZONE: "eu-1a",
        tm.GPU: "g3",
    }
    assert tm.route_attributes("eu-1a/g3") == {tm.ZONE: "eu-1a", tm.GPU: "g3"}
    assert tm.route_attributes("") == {}


def test_error_status_set_from_grpc_code() -> None:
    telemetry = tm.setup_tracing("svc")
    span = telemetry.tracer.start_span("x")
    tm.end_span(span, grpc.StatusCode.UNAVAILABLE, "no GPU")
    assert telemetry.recent is not None
    (done,) = telemetry.recent.spans()
    assert not done.status.is_ok
    assert done.status.description == "UNAVAILABLE: no GPU"
    assert (done.attributes or {})[tm.STATUS] == grpc.StatusCode.UNAVAILABLE.value[0]


def test_a_sampled_out_request_passes_its_decision_down(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracing = tm.TierTracing(tm.setup_tracing("svc").tracer, "global")
    span = tracing.server_span("ModelInfer", [])
    assert not span.is_recording() and span.get_span_context().is_valid
    assert tracing.decision_started(span) == 0  # no decision or attempt spans below it
    (sent,) = tm.inject_context([], span)
    assert sent[0] == "traceparent"
    assert int(sent[1].rsplit("-", 1)[1], 16) & 1 == 0  # the sampled flag is off
