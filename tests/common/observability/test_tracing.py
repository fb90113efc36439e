"""Tracing set-up: the span ring, W3C context in metadata, the OTel env vars."""

from __future__ import annotations

import io
import json
import os
import time
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import SpanKind

from common.config.node import ConfigError, Endpoint
from common.observability import tracing as tm
from common.observability.otel_env import build_propagator
from common.request.balancer import Lease
from common.request.call import CallRecord
from common.request.children import Child

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


# ---------------------------------------------------------------- conventions


def _lease(name: str = "g1", port: int = 7001) -> Lease:
    child = Child(name, Endpoint("127.0.0.1", port), frozenset({"m"}))
    return Lease(child, 1.0, 0.0, model="m", planned_output=8, reason="prefix", cached_blocks=3)


def _call(tracing: tm.TierTracing, **fields: Any) -> CallRecord:
    call = CallRecord("ModelInfer", [("traceparent", TRACEPARENT)], time.monotonic())
    tracing.call_started(call)
    for key, value in fields.items():
        setattr(call, key, value)
    return call


def test_a_call_gets_rpc_and_gen_ai_attributes_under_the_conventional_name() -> None:
    telemetry = tm.setup_tracing("svc")
    tracing = tm.TierTracing(telemetry.tracer, "local", telemetry.propagator)
    tracing.serve_at("127.0.0.1", 9001)
    call = _call(tracing, model="m", prompt_tokens=5, completion_tokens=7, max_tokens=16)
    call.route, call.code = "eu-1a/g1", grpc.StatusCode.OK
    lease = _lease()
    started = tracing.decision_started(call.span)
    tracing.record_decision(call.span, started, lease)
    tracing.begin_attempt("ModelInfer", lease, 1, call.span)
    tracing.end_attempt(lease, grpc.StatusCode.OK, "", 0.25)
    tracing.call_ended(call)
    assert telemetry.recent is not None
    spans = {s.name: s for s in telemetry.recent.spans() if s.kind != SpanKind.CLIENT}
    (client,) = [s for s in telemetry.recent.spans() if s.kind == SpanKind.CLIENT]
    server = spans["inference.GRPCInferenceService/ModelInfer"]
    assert client.name == server.name
    assert dict(server.attributes or {}) == {
        "meridian.tier": "local",
        "rpc.system": "grpc",
        "rpc.service": "inference.GRPCInferenceService",
        "rpc.method": "ModelInfer",
        "server.address": "127.0.0.1",
        "server.port": 9001,
        "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 7,
        "meridian.usage.estimated": True,
        "meridian.route.zone": "eu-1a",
        "meridian.route.gpu": "g1",
        "meridian.tenant": "anonymous",
        "rpc.grpc.status_code": 0,
        "rpc.response.status_code": "OK",
    }
    assert dict(client.attributes or {}) == {
        "rpc.system": "grpc",
        "rpc.service": "inference.GRPCInferenceService",
        "rpc.method": "ModelInfer",
        "server.address": "127.0.0.1",
        "server.port": 7001,
        "meridian.child": "g1",
        "meridian.attempt.index": 1,
        "meridian.attempt.actual_s": 0.25,
        "rpc.grpc.status_code": 0,
        "rpc.response.status_code": "OK",
    }
    assert dict(spans["pick"].attributes or {}) == {
        "meridian.child": "g1",
        "meridian.decision.reason": "prefix",
        "meridian.decision.candidates": 0,
        "meridian.decision.cached_blocks": 3,
    }


def test_reported_token_counts_are_not_marked_estimated() -> None:
    telemetry = tm.setup_tracing("svc")
    tracing = tm.TierTracing(telemetry.tracer, "global")
    call = _call(tracing, prompt_tokens=3, completion_tokens=2, tokens_reported=True)
    call.code = grpc.StatusCode.OK
    tracing.call_ended(call)
    assert telemetry.recent is not None
    (server,) = telemetry.recent.spans()
    assert (server.attributes or {})["meridian.usage.estimated"] is False


class DropAll(Sampler):
    """Drops every span, keeping the attributes each start was handed."""

    def __init__(self) -> None:
        self.handed: list[object] = []

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        attributes = kwargs["attributes"] if "attributes" in kwargs else args[4]
        self.handed.append(attributes)
        return SamplingResult(Decision.DROP)

    def get_description(self) -> str:
        return "DropAll"


def test_a_dropped_request_builds_no_attributes() -> None:
    sampler = DropAll()
    tracing = tm.TierTracing(TracerProvider(sampler=sampler).get_tracer("t"), "local")
    tracing.serve_at("127.0.0.1", 9001)
    spans = [tracing.server_span("ModelInfer", [("traceparent", TRACEPARENT)]) for _ in range(3)]
    assert not any(span.is_recording() for span in spans)
    # Every start was handed the one dict built when the tier started serving.
    assert len(sampler.handed) == 3 and all(a is sampler.handed[0] for a in sampler.handed)
    lease = _lease()
    assert tracing.decision_started(spans[0]) == 0
    tracing.begin_attempt("ModelInfer", lease, 0, spans[0])
    assert lease.span is None and len(sampler.handed) == 3


def test_the_console_exporter_writes_each_span_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    out = io.StringIO()
    telemetry = tm.setup_tracing("meridian-local", out=out)
    assert telemetry.exporting
    tracing = tm.TierTracing(telemetry.tracer, "local")
    call = _call(tracing, model="m", prompt_tokens=2, completion_tokens=4)
    call.code = grpc.StatusCode.OK
    tracing.call_ended(call)
    telemetry.shutdown()  # flushes the batch
    decoder, text, printed = json.JSONDecoder(), out.getvalue(), []
    while text.strip():
        span, end = decoder.raw_decode(text.lstrip())
        printed.append(span)
        text = text.lstrip()[end:]
    (span,) = printed
    assert span["name"] == "inference.GRPCInferenceService/ModelInfer"
    assert span["kind"] == "SpanKind.SERVER"
    assert span["context"]["trace_id"] == f"0x{TRACE}"
    assert span["attributes"]["rpc.system"] == "grpc"
    assert span["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert span["resource"]["attributes"]["service.name"] == "meridian-local"


def test_a_bad_variable_fails_the_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_PROPAGATORS", "xray")
    with pytest.raises(ConfigError, match="OTEL_PROPAGATORS: unknown value 'xray'"):
        tm.setup_tracing("svc")


# ---------------------------------------------------------------- propagators

B3_TRACE, B3_SPAN = "80f198ee56343ba864fe8b2a57d3eff7", "e457b5a2e4d86bd1"


def test_b3_single_header_extracted_and_injected_in_its_place() -> None:
    b3 = build_propagator(("b3",))
    parent = tm.extract_context([("b3", f"{B3_TRACE}-{B3_SPAN}-1")], b3)
    telemetry = tm.setup_tracing("svc")
    span = telemetry.tracer.start_span("server", context=parent)
    assert format(span.get_span_context().trace_id, "032x") == B3_TRACE
    # A traceparent the caller also sent goes no further: the tier below reads b3.
    sent = dict(tm.inject_context([("traceparent", TRACEPARENT), ("x-k", "v")], span, b3))
    own = format(span.get_span_context().span_id, "016x")
    assert sent == {"x-k": "v", "b3": f"{B3_TRACE}-{own}-1"}


def test_b3_multi_headers_round_trip() -> None:
    b3 = build_propagator(("b3multi",))
    incoming = [("x-b3-traceid", B3_TRACE), ("x-b3-spanid", B3_SPAN), ("x-b3-sampled", "1")]
    span = tm.setup_tracing("svc").tracer.start_span("s", context=tm.extract_context(incoming, b3))
    sent = dict(tm.inject_context(list(incoming), span, b3))
    assert sent["x-b3-traceid"] == B3_TRACE
    assert sent["x-b3-spanid"] == format(span.get_span_context().span_id, "016x")


def test_baggage_goes_down_only_with_the_baggage_propagator() -> None:
    span = tm.setup_tracing("svc").tracer.start_span("s")
    metadata = [("traceparent", TRACEPARENT), ("baggage", "team=infra")]
    assert dict(tm.inject_context(metadata, span))["baggage"] == "team=infra"
    only_w3c = build_propagator(("tracecontext",))
    assert "baggage" not in dict(tm.inject_context(metadata, span, only_w3c))
