"""One request's trace put back together from the spans each tier kept.

Every tier keeps its own recent spans (``/api/traces``); a request's trace is
spread over the global tier, one regional tier and one local tier. ``merge_traces``
joins them by trace id (a span seen twice is kept once) and ``summarize`` turns
one trace into what the dashboard lists: when, how long, status, the route
(region → zone → GPU), and for each tier the child it chose, why (the ``pick``
span's reason), among how many candidates, and how many attempts it took; plus
the spans themselves with offsets and depths for a timeline. ``passed_through``
names the regions and zones a summarized trace went through.

Pure functions over the JSON ``common.operations.ops_http.span_json`` writes; no I/O here. The
other tiers' answers are read defensively: a trace or span of the wrong shape is
skipped and a field of the wrong type reads as missing, so one odd answer cannot
fail the merge.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from common.observability import trace_names as tm

TIER_ORDER = {"global": 0, "regional": 1, "local": 2}

Span = dict[str, Any]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _ns(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def clean_span(raw: Any, source: str) -> Span | None:
    """A reported span with every field the summary reads of the type it expects
    (a wrong one reads as missing), tagged with its ``source``; None if not a span."""
    if not isinstance(raw, dict):
        return None
    attributes = raw.get("attributes")
    attributes = {
        str(k): v if isinstance(v, str | int | float | bool) else str(v)
        for k, v in (attributes.items() if isinstance(attributes, dict) else ())
        # NaN and infinities would make the answer invalid JSON for the page.
        if not (isinstance(v, float) and not math.isfinite(v))
    }
    if not isinstance(attributes.get(tm.TIER, ""), str) or attributes.get(tm.TIER) == "":
        del attributes[tm.TIER]
    return {
        "name": _text(raw.get("name")) or "",
        "span_id": _text(raw.get("span_id")),
        "parent_id": _text(raw.get("parent_id")),
        "start_ns": _ns(raw.get("start_ns")),
        "end_ns": _ns(raw.get("end_ns")),
        "attributes": attributes,
        "status": _text(raw.get("status")),
        "source": source,
    }


def merge_traces(sources: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, list[Span]]:
    """Spans by trace id from ``(source name, /api/traces body)`` pairs; each span gets
    ``source`` (which process kept it), each trace its spans in start order."""
    merged: dict[str, dict[str, Span]] = {}
    for source, body in sources:
        for trace in _list(body.get("traces")):
            trace_id = _text(trace.get("trace_id")) if isinstance(trace, dict) else None
            if trace_id is None:
                continue
            spans = merged.setdefault(trace_id, {})
            for raw in _list(trace.get("spans")):
                span = clean_span(raw, source)
                if span is not None:
                    key = span["span_id"] or f"{source}:{len(spans)}"
                    spans.setdefault(key, span)
    return {
        tid: sorted(spans.values(), key=lambda s: s.get("start_ns") or 0)
        for tid, spans in merged.items()
        if spans
    }


def _tiers(spans: list[Span]) -> dict[str, str]:
    """The tier of every span: a server span names it, the others inherit it."""
    by_id = {s["span_id"]: s for s in spans if s.get("span_id")}
    tiers: dict[str, str] = {}

    def tier_of(span: Span, depth: int = 0) -> str:
        sid = span.get("span_id", "")
        if sid in tiers:
            return tiers[sid]
        tier = span.get("attributes", {}).get(tm.TIER)
        if tier is None:
            parent = by_id.get(span.get("parent_id") or "")
            tier = tier_of(parent, depth + 1) if parent is not None and depth < 64 else ""
        tiers[sid] = str(tier)
        return tiers[sid]

    for span in spans:
        tier_of(span)
    return tiers


def _depths(spans: list[Span]) -> dict[str, int]:
    by_id = {s["span_id"]: s for s in spans if s.get("span_id")}
    depths: dict[str, int] = {}
    for span in spans:
        depth, parent = 0, by_id.get(span.get("parent_id") or "")
        while parent is not None and depth < 64:
            depth += 1
            parent = by_id.get(parent.get("parent_id") or "")
        depths[span.get("span_id", "")] = depth
    return depths


def summarize(trace_id: str, spans: list[Span]) -> dict[str, Any]:
    """One trace as the dashboard lists it (see the module docstring)."""
    start = min((s.get("start_ns") or 0) for s in spans)
    end = max((s.get("end_ns") or s.get("start_ns") or 0) for s in spans)
    servers = sorted(
        (s for s in spans if tm.TIER in s.get("attributes", {})),
        key=lambda s: (TIER_ORDER.get(s["attributes"][tm.TIER], 9), s.get("start_ns") or 0),
    )
    top = servers[0] if servers else spans[0]
    top_attrs = top.get("attributes", {})
    route = {
        key: top_attrs.get(attr)
        or next((s["attributes"][attr] for s in servers if attr in s["attributes"]), None)
        for key, attr in (("region", tm.REGION), ("zone", tm.ZONE), ("gpu", tm.GPU))
    }
    hops = [_hop(server, spans) for server in servers]
    return {
        "trace_id": trace_id,
        "start_ns": start,
        "duration_ms": round((end - start) / 1e6, 3),
        "name": top.get("name", ""),
        "model": top_attrs.get(tm.MODEL),
        "tenant": top_attrs.get(tm.TENANT),
        "ok": all(s.get("status") != "ERROR" for s in servers),
        "grpc_status": top_attrs.get(tm.STATUS),
        "route": route,
        "tiers": sorted({h["tier"] for h in hops}, key=lambda t: TIER_ORDER.get(t, 9)),
        "hops": hops,
        "spans": _span_rows(spans, start),
    }


def _hop(server: Span, spans: list[Span]) -> dict[str, Any]:
    """What one tier's server span did: its pick, its attempts, its time in the queue."""
    sid = server.get("span_id")
    children = [s for s in spans if s.get("parent_id") == sid]
    picks = [s for s in children if s.get("name") == "pick"]
    attempts = [s for s in children if s.get("name") not in ("pick", "queue")]
    pick = picks[-1]["attributes"] if picks else {}
    queued = [s for s in _under(spans, picks) if s.get("name") == "queue"]
    return {
        "tier": server["attributes"][tm.TIER],
        "source": server.get("source", ""),
        "child": pick.get(tm.CHILD),
        "reason": pick.get(tm.REASON),
        "candidates": pick.get(tm.CANDIDATES),
        "policy": pick.get(tm.POLICY),
        "estimated_ms": _ms(pick.get(tm.ESTIMATED_S)),
        "attempts": len(attempts),
        "queued_ms": sum(_duration_ms(s) for s in queued) if queued else None,
        "status": server.get("status"),
    }


def _span_rows(spans: list[Span], start: int) -> list[dict[str, Any]]:
    """Every span as the waterfall draws it: tier, depth and offset from the trace start."""
    tiers = _tiers(spans)
    depths = _depths(spans)
    return [
        {
            "span_id": s.get("span_id"),
            "parent_id": s.get("parent_id"),
            "name": s.get("name", ""),
            "tier": tiers.get(s.get("span_id", ""), ""),
            "source": s.get("source", ""),
            "depth": depths.get(s.get("span_id", ""), 0),
            "offset_ms": round(((s.get("start_ns") or start) - start) / 1e6, 3),
            "duration_ms": _duration_ms(s),
            "status": s.get("status"),
            "attributes": s.get("attributes", {}),
        }
        for s in spans
    ]


def _under(spans: list[Span], parents: list[Span]) -> list[Span]:
    ids = {p.get("span_id") for p in parents}
    return [s for s in spans if s.get("parent_id") in ids]


def _duration_ms(span: Span) -> float:
    start, end = span.get("start_ns") or 0, span.get("end_ns") or 0
    return round(max(0, end - start) / 1e6, 3)


def _ms(seconds: Any) -> float | None:
    return round(float(seconds) * 1000, 3) if isinstance(seconds, int | float) else None


def recent_traces(merged: Mapping[str, list[Span]], limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` merged traces, summarized, newest first."""
    newest = sorted(
        merged.items(), key=lambda item: min(s.get("start_ns") or 0 for s in item[1]), reverse=True
    )
    return [summarize(tid, spans) for tid, spans in newest[:limit] if spans]


def passed_through(trace: Mapping[str, Any]) -> set[str]:
    """The regions and zones a summarized trace names: its route and every child a
    tier picked or tried. Were one of their tiers silent, its spans may be missing."""
    names = {v for v in trace["route"].values() if isinstance(v, str)}
    for span in trace["spans"]:
        child = span["attributes"].get(tm.CHILD)
        if isinstance(child, str):
            names.add(child)
    return names
