"""Traces put back together from the spans each tier kept."""

from __future__ import annotations

from typing import Any

from common.observability import tracing as tm
from common.observability.trace_view import merge_traces, passed_through, recent_traces, summarize

TRACE = "ab" * 16
MS = 1_000_000


def span(
    sid: str, parent: str | None, name: str, start_ms: float, end_ms: float, **attrs: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "span_id": sid,
        "parent_id": parent,
        "start_ns": int(start_ms * MS),
        "end_ns": int(end_ms * MS),
        "attributes": attrs,
        "status": "UNSET",
    }


def one_request() -> list[tuple[str, dict[str, Any]]]:
    """What the global, one regional and one local tier keep of one request."""
    route = {tm.REGION: "eu", tm.ZONE: "eu-1a", tm.GPU: "eu-1a-gpu0"}
    glob = [
        span("g", None, "ModelInfer", 0, 10, **{tm.TIER: "global", tm.MODEL: "m"}, **route),
        span(
            "gp",
            "g",
            "pick",
            0.1,
            0.2,
            **{tm.CHILD: "eu", tm.REASON: "nearest region"},
            **{tm.CANDIDATES: 3},
        ),
        span("ga", "g", "ModelInfer eu", 0.3, 9.8, **{tm.CHILD: "eu", tm.ATTEMPT: 0}),
    ]
    regional = [
        span("r", "ga", "ModelInfer", 1, 9, **{tm.TIER: "regional"}),
        span("rp", "r", "pick", 1.1, 1.2, **{tm.CHILD: "eu-1a", tm.REASON: "nearest zone"}),
        span("ra1", "r", "ModelInfer eu-1b", 1.3, 2, **{tm.CHILD: "eu-1b", tm.ATTEMPT: 0}),
        span("ra2", "r", "ModelInfer eu-1a", 2.1, 8.9, **{tm.CHILD: "eu-1a", tm.ATTEMPT: 1}),
    ]
    local = [
        span("l", "ra2", "ModelInfer", 3, 8, **{tm.TIER: "local"}),
        span(
            "lp",
            "l",
            "pick",
            3.1,
            5.1,
            **{tm.CHILD: "eu-1a-gpu0", tm.REASON: "queue"},
            **{tm.POLICY: "CompletionTimePicker", tm.ESTIMATED_S: 0.004},
        ),
        span("lq", "lp", "queue", 3.6, 5.1, **{tm.CHILD: "eu-1a-gpu0"}),
        span("la", "l", "ModelInfer eu-1a-gpu0", 5.2, 7.9, **{tm.CHILD: "eu-1a-gpu0"}),
    ]
    return [
        ("global", {"traces": [{"trace_id": TRACE, "spans": glob}]}),
        ("regional eu", {"traces": [{"trace_id": TRACE, "spans": regional}]}),
        # A span reported twice (a tier asked twice) is kept once.
        ("local eu-1a", {"traces": [{"trace_id": TRACE, "spans": [*local, local[0]]}]}),
    ]


def test_spans_of_every_tier_join_into_one_trace() -> None:
    merged = merge_traces(one_request())
    assert list(merged) == [TRACE]
    spans = merged[TRACE]
    assert len(spans) == 11
    assert [s["start_ns"] for s in spans] == sorted(s["start_ns"] for s in spans)
    assert {s["source"] for s in spans} == {"global", "regional eu", "local eu-1a"}


def test_summary_says_the_route_and_why_each_hop_chose() -> None:
    summary = summarize(TRACE, merge_traces(one_request())[TRACE])
    assert summary["route"] == {"region": "eu", "zone": "eu-1a", "gpu": "eu-1a-gpu0"}
    assert summary["tiers"] == ["global", "regional", "local"]
    assert summary["duration_ms"] == 10.0 and summary["ok"] is True
    assert summary["model"] == "m"
    hops = {h["tier"]: h for h in summary["hops"]}
    assert hops["global"]["reason"] == "nearest region" and hops["global"]["candidates"] == 3
    assert hops["regional"]["child"] == "eu-1a" and hops["regional"]["attempts"] == 2
    assert hops["local"]["reason"] == "queue"
    assert hops["local"]["queued_ms"] == 1.5
    assert hops["local"]["estimated_ms"] == 4.0


def test_timeline_spans_carry_tier_depth_and_offset() -> None:
    summary = summarize(TRACE, merge_traces(one_request())[TRACE])
    spans = {s["span_id"]: s for s in summary["spans"]}
    assert spans["g"]["depth"] == 0 and spans["g"]["offset_ms"] == 0
    assert spans["lq"]["depth"] == 6  # g > ga > r > ra2 > l > lp > lq
    assert spans["lq"]["tier"] == "local" and spans["gp"]["tier"] == "global"
    assert spans["la"]["offset_ms"] == 5.2 and spans["la"]["duration_ms"] == 2.7


def test_a_failed_server_span_marks_the_trace_failed() -> None:
    sources = one_request()
    sources[1][1]["traces"][0]["spans"][0]["status"] = "ERROR"
    (summary,) = recent_traces(merge_traces(sources), 10)
    assert summary["ok"] is False


def test_newest_first_and_limited() -> None:
    traces = {
        f"{i:032x}": [span(f"s{i}", None, "ModelInfer", i, i + 1, **{tm.TIER: "global"})]
        for i in range(5)
    }
    assert [t["trace_id"] for t in recent_traces(traces, 2)] == [f"{4:032x}", f"{3:032x}"]


def test_passed_through_names_the_route_and_every_child_tried() -> None:
    (summary,) = recent_traces(merge_traces(one_request()), 1)
    assert passed_through(summary) == {"eu", "eu-1a", "eu-1b", "eu-1a-gpu0"}


def test_what_is_not_a_trace_or_a_span_is_skipped() -> None:
    glob, regional, local = one_request()
    odd = {
        "traces": [
            "not a trace",
            {"trace_id": 7, "spans": []},
            {"trace_id": TRACE, "spans": "not a list"},
            {
                "trace_id": TRACE,
                "spans": [
                    None,
                    {"span_id": ["x"], "start_ns": "soon", "attributes": {tm.TIER: 3}},
                ],
            },
        ]
    }
    merged = merge_traces([glob, regional, local, ("local eu-1b", odd)])
    spans = merged[TRACE]
    assert len(spans) == 12  # the eleven, and the odd span with its odd fields unknown
    (weird,) = [s for s in spans if s["source"] == "local eu-1b"]
    assert (weird["span_id"], weird["start_ns"], weird["attributes"]) == (None, None, {})
    (summary,) = recent_traces(merged, 1)
    assert summary["tiers"] == ["global", "regional", "local"]


def test_non_finite_numbers_and_an_empty_tier_are_dropped() -> None:
    odd = {
        "traces": [
            {
                "trace_id": TRACE,
                "spans": [
                    span("aa", None, "ModelInfer", 0, 1, **{tm.TIER: "", "x": float("nan")}),
                    span("bb", "aa", "pick", 0, 1, y=float("inf"), z=1.5),
                ],
            }
        ]
    }
    spans = merge_traces([("global", odd)])[TRACE]
    assert [s["attributes"] for s in spans] == [{}, {"z": 1.5}]
