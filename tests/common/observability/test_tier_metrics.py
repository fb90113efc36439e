"""A tier's metric families: names and label sets pinned (a rename is a conscious
change), and what one request's record turns into."""

from __future__ import annotations

import math
import time

import grpc
import pytest

from common.basics.vocabulary import Priority
from common.config.node import Endpoint
from common.gen.meridian.v1 import capacity_pb2
from common.observability.decisions import DECISION_REASONS, decision_reason
from common.observability.dependency_metrics import add_redis_metrics, add_usage_metrics
from common.observability.metrics import counter_values, histogram_counts
from common.observability.tier_metrics import (
    EjectionCounter,
    TierMetrics,
    add_local_metrics,
)
from common.request.balancer import Lease
from common.request.call import STREAM_METHOD, CallRecord
from common.request.children import Child, ChildSet
from common.request.pick import PickRequest
from common.request.routing import RouteHints
from tests.common.observability.test_metrics import parse, plain

MODEL = "llama-3-8b"

# Every family a tier exposes, its type and its labels. Changing this table is changing
# what dashboards and alerts (deploy/grafana, deploy/prometheus) and operators query.
PINNED: dict[str, tuple[str, frozenset[str]]] = {
    "meridian_requests": ("counter", frozenset({"tier", "model", "status", "tenant"})),
    "meridian_streams": ("counter", frozenset({"tier", "status", "tenant"})),
    "meridian_request_duration_seconds": (
        "histogram",
        frozenset({"tier", "model", "status", "tenant"}),
    ),
    "meridian_time_to_first_token_seconds": ("histogram", frozenset({"tier", "model", "tenant"})),
    "meridian_time_per_output_token_seconds": (
        "histogram",
        frozenset({"tier", "model", "tenant"}),
    ),
    "meridian_prompt_tokens": ("counter", frozenset({"tier", "model", "tenant"})),
    "meridian_generation_tokens": ("counter", frozenset({"tier", "model", "tenant"})),
    "meridian_retries": ("counter", frozenset({"tier"})),
    "meridian_sheds": ("counter", frozenset({"tier", "tenant", "reason"})),
    "meridian_decisions": ("counter", frozenset({"tier", "model", "reason"})),
    "meridian_child_healthy": ("gauge", frozenset({"tier", "child"})),
    "meridian_child_capacity_report_age_seconds": ("gauge", frozenset({"tier", "child"})),
    "meridian_child_capacity_report_fresh": ("gauge", frozenset({"tier", "child"})),
    "meridian_capacity_report_ttl_seconds": ("gauge", frozenset({"tier"})),
    "meridian_redis_up": ("gauge", frozenset({"tier", "client"})),
    # The edge's usage records on their way to Redis.
    "meridian_usage_records_written": ("counter", frozenset({"tier"})),
    "meridian_usage_records_dropped": ("counter", frozenset({"tier"})),
    "meridian_usage_records_pending": ("gauge", frozenset({"tier"})),
    # The local tier's own.
    "meridian_queue_wait_seconds": ("histogram", frozenset({"tier", "model", "tenant"})),
    "meridian_queue_depth": ("gauge", frozenset({"tier", "priority"})),
    "meridian_ejections": ("counter", frozenset({"tier"})),
}


class Usage:
    written, dropped, pending = 7, 0, 2


def children() -> ChildSet:
    child = Child("us-east-1a", Endpoint("127.0.0.1", 1), frozenset({MODEL}))
    return ChildSet([child], probe_interval_s=1, summary_ttl_s=3, probe=False)


def metrics(summaries: bool = True) -> TierMetrics:
    return TierMetrics("local", children(), models={MODEL}, tenants={"acme"}, summaries=summaries)


def record(
    method: str = "ModelInfer",
    *,
    code: grpc.StatusCode = grpc.StatusCode.OK,
    elapsed: float = 1.0,
    first: float | None = 0.2,
    tokens: tuple[int, int] = (12, 9),
    streamed: bool = False,
    tenant: str = "acme",
    model: str = MODEL,
    detail: str = "",
    of_stream: bool = False,
) -> CallRecord:
    call = CallRecord(method, (), time.monotonic() - elapsed, hints=hints(tenant))
    if of_stream:  # one request of a stream (CallRecord.for_request)
        call.stream = CallRecord(STREAM_METHOD, (), call.started)
    call.model, call.code, call.detail = model, code, detail
    call.first_response_s, call.streamed = first, streamed
    call.prompt_tokens, call.completion_tokens = tokens
    return call


def hints(tenant: str) -> RouteHints:
    return RouteHints(None, None, None, Priority.STANDARD, 1, (), tenant=tenant)


def pick(model: str = MODEL, tenant: str = "acme") -> PickRequest:
    return PickRequest(model, "", None, None, Priority.STANDARD, tenant=tenant)


def families(m: TierMetrics) -> dict[str, tuple[str, frozenset[str]]]:
    out = {}
    for family in m.registry.collect():
        if family.name.startswith("meridian_"):
            labels = {k for s in family.samples for k in s.labels if k != "le"}
            out[family.name] = (family.type, frozenset(labels))
    return out


def test_metric_names_and_label_sets_are_pinned() -> None:
    m = metrics()
    add_local_metrics(m, lambda: {"standard": 2}, EjectionCounter(frozenset))
    add_redis_metrics(m, {"capacity_publisher": lambda: True})
    add_usage_metrics(m, Usage())
    stream = record(STREAM_METHOD)
    m.call_ended(stream)
    m.call_ended(record(code=grpc.StatusCode.RESOURCE_EXHAUSTED, detail="tokens_per_min"))
    m.call_ended(record(streamed=True))
    m.retries.labels("local").inc()
    child = next(iter(m.children))
    m.decided(pick(), "queued", Lease(child, 1.0, 0.0, queued_s=0.5))
    assert families(m) == PINNED
    names = {name for name, _, _ in parse(plain(m.registry))}
    assert "meridian_child_summary_age_seconds" not in names  # promtool: no type word
    assert {"process_cpu_seconds_total", "python_gc_collections_total"} <= names


def test_a_unary_answer_counts_its_latency_first_response_and_tokens_not_tpot() -> None:
    m = metrics()
    m.call_ended(record(elapsed=1.0, first=1.0, tokens=(12, 9)))
    key = ("local", MODEL, "acme")
    assert counter_values(m.requests, ("tier", "model", "status", "tenant")) == {
        ("local", MODEL, "OK", "acme"): 1.0
    }
    assert counter_values(m.prompt_tokens, ("tier", "model", "tenant")) == {key: 12.0}
    assert counter_values(m.generation_tokens, ("tier", "model", "tenant")) == {key: 9.0}
    assert sum(histogram_counts(m.ttft, ())[()]) == 1
    assert histogram_counts(m.tpot, ()) == {(): [0.0] * 13}  # no token timing in a unary answer


def test_a_streamed_request_observes_time_per_output_token_after_the_first() -> None:
    m = metrics()
    request = {"method": STREAM_METHOD, "of_stream": True, "elapsed": 1.0, "first": 0.1}
    m.call_ended(record(**request, tokens=(3, 10), streamed=True))
    m.call_ended(record(**request, tokens=(3, 1), streamed=True))  # one token only
    m.call_ended(record(**request, tokens=(3, 10), streamed=False))  # asked stream: false
    [family] = m.tpot.collect()
    sums = [s.value for s in family.samples if s.name.endswith("_sum")]
    counts = [s.value for s in family.samples if s.name.endswith("_count")]
    # (latency - first response) / (tokens - 1): 0.9 s over 9 tokens; only this one counted.
    assert counts == [1.0] and sums == [pytest.approx(0.1, abs=0.01)]


def test_a_request_refused_before_any_response_counts_no_tokens_and_a_shed() -> None:
    m = metrics()
    m.call_ended(record(code=grpc.StatusCode.RESOURCE_EXHAUSTED, first=None, detail="x"))
    assert counter_values(m.prompt_tokens, ()).get((), 0.0) == 0.0
    assert sum(histogram_counts(m.ttft, ()).get((), [])) == 0
    assert counter_values(m.sheds, ("tier", "tenant", "reason")) == {
        ("local", "acme", "capacity"): 1.0
    }


def test_labels_outside_the_configured_models_and_tenants_are_dashes() -> None:
    m = metrics()
    m.call_ended(record(model="whatever-a-client-sent", tenant="who-knows"))
    assert counter_values(m.requests, ("model", "tenant")) == {("-", "-"): 1.0}


def test_a_stream_counts_as_a_stream_its_requests_on_their_own() -> None:
    m = metrics()
    m.call_ended(record(STREAM_METHOD))
    assert counter_values(m.streams, ("tier", "status", "tenant")) == {("local", "OK", "acme"): 1}
    assert counter_values(m.requests, ()) == {}


def test_decisions_count_by_reason_and_the_local_queue_wait() -> None:
    m = metrics(summaries=False)
    add_local_metrics(m, dict, EjectionCounter(frozenset))
    child = next(iter(m.children))
    m.decided(pick(), decision_reason("prefix"), Lease(child, 1.0, 0.0))
    m.decided(pick(), decision_reason("queue"), Lease(child, 1.0, 0.0, queued_s=2.0))
    m.decided(pick(), "refused_full", None)
    assert counter_values(m.decisions, ("reason",)) == {
        ("prefix_hit",): 1.0,
        ("queued",): 1.0,
        ("refused_full",): 1.0,
    }
    assert m.queue_wait is not None
    waits = histogram_counts(m.queue_wait, ("model", "tenant"))[(MODEL, "acme")]
    assert sum(waits) == 2 and waits[0] == 1  # bound at once: a wait of 0


def test_every_balancer_reason_has_a_label_and_unknown_ones_are_other() -> None:
    assert decision_reason("nearest zone") == decision_reason("nearest region") == "home"
    assert decision_reason("something new") == "other"
    assert all(v.isidentifier() for v in DECISION_REASONS.values())


def test_capacity_report_age_is_nan_until_one_arrives_and_fresh_within_ttl() -> None:
    m = metrics()
    samples = {n: v for n, _, v in parse(plain(m.registry)) if "capacity_report" in n}
    assert math.isnan(samples["meridian_child_capacity_report_age_seconds"])
    assert samples["meridian_child_capacity_report_fresh"] == 0.0
    assert samples["meridian_capacity_report_ttl_seconds"] == 3.0
    m.children.take_summary("us-east-1a", capacity_pb2.CapacitySummary(source_id="z", sequence=1))
    samples = {n: v for n, _, v in parse(plain(m.registry)) if "capacity_report" in n}
    assert samples["meridian_child_capacity_report_age_seconds"] < 1.0
    assert samples["meridian_child_capacity_report_fresh"] == 1.0


def test_a_tier_without_summaries_has_no_capacity_report_families() -> None:
    names = {name for name, _, _ in parse(plain(metrics(summaries=False).registry))}
    assert not any("capacity_report" in n for n in names)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def exemplars(m: TierMetrics) -> dict[str, str]:
    """Each duration bucket's exemplar trace id, by its bound."""
    [family] = m.duration.collect()
    return {s.labels["le"]: s.exemplar.labels["trace_id"] for s in family.samples if s.exemplar}


def traced(trace_id: str, elapsed: float) -> CallRecord:
    call = record(elapsed=elapsed)
    assert call.hints is not None
    parent = ("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")
    call.hints = RouteHints(None, None, None, Priority.STANDARD, 1, (parent,), tenant="acme")
    return call


def test_a_latency_bucket_takes_an_exemplar_at_most_once_a_second() -> None:
    clock = Clock()
    m = TierMetrics("global", children(), models={MODEL}, tenants={"acme"}, clock=clock)
    a, b, c, d = (f"{i:032x}" for i in (0xA, 0xB, 0xC, 0xD))
    m.call_ended(traced(a, 0.2))
    m.call_ended(traced(b, 0.2))  # same bucket, same second: keeps a's
    m.call_ended(traced(c, 20.0))  # another bucket: its own
    assert exemplars(m) == {"0.25": a, "30.0": c}
    clock.now += 1.0
    m.call_ended(traced(d, 0.2))
    assert exemplars(m) == {"0.25": d, "30.0": c}
