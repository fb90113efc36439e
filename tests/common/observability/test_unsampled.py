"""The cheap path for dropped requests: what it reads, when it applies, what goes down."""

from __future__ import annotations

import os

import pytest
from opentelemetry import trace

from common.config.node import Endpoint
from common.observability import tracing as tm
from common.observability.otel_env import build_propagator
from common.observability.unsampled import inject_unsampled, skips_unsampled, unsampled_parent
from common.request.balancer import Lease
from common.request.children import Child
from common.request.routing import parse_hints

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
DROPPED = f"00-{TRACE}-{PARENT}-00"
SAMPLED = f"00-{TRACE}-{PARENT}-01"


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def _lease() -> Lease:
    child = Child("g1", Endpoint("127.0.0.1", 7001), frozenset({"m"}))
    return Lease(child, 1.0, 0.0, model="m", planned_output=8)


@pytest.mark.parametrize(
    ("value", "dropped"),
    [
        (DROPPED, True),
        (SAMPLED, False),
        (f"00-{TRACE}-{PARENT}-02", True),  # the W3C random flag alone: not sampled
        (f"ff-{TRACE}-{PARENT}-00", False),  # a forbidden version: the propagator ignores it
        (f"00-{TRACE}-{PARENT}-00-extra", False),  # version 00 has exactly four fields
        (f"00-{'0' * 32}-{PARENT}-00", False),  # an invalid trace id
        (f"00-{TRACE}-{'0' * 16}-00", False),  # an invalid parent id
        (f"00-{TRACE.upper()}-{PARENT}-00", False),  # hex must be lower case
        ("garbage", False),
    ],
)
def test_only_a_valid_unsampled_traceparent_counts(value: str, dropped: bool) -> None:
    assert unsampled_parent([("x-other", "1"), ("traceparent", value)]) is dropped


def test_no_traceparent_is_not_an_unsampled_parent() -> None:
    assert not unsampled_parent([("tracestate", "a=b"), ("traceparent", b"binary")])


def test_the_default_sampler_skips_but_not_always_on_nor_b3(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    default = tm.setup_tracing("svc")
    assert skips_unsampled(default.tracer, default.propagator)
    assert not skips_unsampled(default.tracer, build_propagator(("tracecontext", "b3")))
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")  # samples whatever the parent says
    eager = tm.setup_tracing("svc")
    assert not skips_unsampled(eager.tracer, eager.propagator)
    assert not skips_unsampled(trace.NoOpTracer(), default.propagator)


def test_an_inner_tier_passes_an_unsampled_callers_context_down_untouched() -> None:
    telemetry = tm.setup_tracing("svc")
    tracing = tm.TierTracing(telemetry.tracer, "regional", telemetry.propagator)
    metadata = [("traceparent", DROPPED), ("baggage", "k=v"), ("x-meridian-tenant", "t")]
    span = tracing.server_span("ModelInfer", metadata)
    assert span is trace.INVALID_SPAN
    hints = parse_hints(metadata, trust_internal=True)
    down = tracing.child_metadata(hints.downstream_metadata(None, 0), _lease(), span)
    assert ("traceparent", DROPPED) in down and ("baggage", "k=v") in down
    assert telemetry.recent is not None and telemetry.recent.spans() == []


def test_a_sampled_caller_is_still_traced() -> None:
    telemetry = tm.setup_tracing("svc")
    tracing = tm.TierTracing(telemetry.tracer, "regional", telemetry.propagator)
    span = tracing.server_span("ModelInfer", [("traceparent", SAMPLED)])
    assert span.is_recording()
    assert format(span.get_span_context().trace_id, "032x") == TRACE


def test_a_dropped_root_goes_down_as_the_propagator_would_write_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    telemetry = tm.setup_tracing("svc")
    tracing = tm.TierTracing(telemetry.tracer, "global", telemetry.propagator)
    span = tracing.server_span("ModelInfer", [])
    assert not span.is_recording() and span.get_span_context().is_valid
    base = [("x-meridian-attempt", "0"), ("baggage", "k=v")]
    fast = tracing.child_metadata(list(base), _lease(), span)
    assert fast == inject_unsampled(list(base), span)
    assert sorted(fast) == sorted(tm.inject_context(list(base), span, telemetry.propagator))
