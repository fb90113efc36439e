"""bench.tracing_hooks: tracing's own calls timed with the real SDK providers."""

from __future__ import annotations

import random

import pytest
from opentelemetry import trace

from bench.tracing_hooks import chain_cost, hook_costs, no_op_tracing, one_request, parents
from bench.tracing_overhead import telemetry_for
from common.config.node import Endpoint
from common.observability.tracing import TierTracing
from common.request.child import Child


def test_a_request_passes_its_context_down_as_a_tier_does() -> None:
    telemetry = telemetry_for("on")
    try:
        tracing = TierTracing(telemetry.tracer, "local", telemetry.propagator)
        child = Child("gpu-0", Endpoint("127.0.0.1", 9000), frozenset({"m"}))
        caller = parents(True, 1, random.Random(1))[0]
        down = dict(one_request(tracing, caller, child))
        assert telemetry.recent is not None
        spans = telemetry.recent.spans()
        # Three spans (server, pick, attempt) in the caller's trace; the child gets the
        # attempt span's context.
        trace_id = caller[-1][1].split("-")[1]
        assert sorted(s.kind.name for s in spans) == ["CLIENT", "INTERNAL", "SERVER"]
        assert {format(s.context.trace_id, "032x") for s in spans} == {trace_id}
        attempt = next(s for s in spans if s.kind == trace.SpanKind.CLIENT)
        assert down["traceparent"] == f"00-{trace_id}-{attempt.context.span_id:016x}-01"
    finally:
        telemetry.shutdown()


def test_what_tracing_costs_orders_as_the_sampler_says() -> None:
    modes = {"off": no_op_tracing(), "on": telemetry_for("on"), "10%": telemetry_for("10%")}
    try:
        # Medians of three rounds: one garbage collection cannot reorder the modes.
        costs = hook_costs(modes, requests=1000, rounds=3)
    finally:
        for telemetry in modes.values():
            telemetry.shutdown()
    edge = {mode: costs[mode]["edge"] for mode in modes}
    assert edge["off"] < edge["10%"] < edge["on"]
    # Below the edge a dropped request costs next to nothing; a traced one, its spans.
    assert costs["10%"]["below, unsampled parent"] < costs["10%"]["below, sampled parent"] / 5


def test_the_chain_adds_two_tiers_below_the_edge_traced_when_the_edge_traced() -> None:
    costs = {"edge": 20.0, "below, unsampled parent": 4.0, "below, sampled parent": 124.0}
    assert chain_cost(costs, 0.1) == pytest.approx(20.0 + 2 * (0.9 * 4.0 + 0.1 * 124.0))
    assert chain_cost(costs, 0.0) == pytest.approx(28.0)
