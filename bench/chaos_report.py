"""The chaos bench's figures per phase, its table, and the JSON it writes.

Per fault: the failed calls bucketed by the time from the fault to the failure (0–0.5,
0.5–1, 1–2, > 2 s; goal: none after 2 s) with their status codes; good traffic's latency
before and after the fault; usage records lost, doubled and erased (``chaos_usage``); and
the limited tenant's quota: requests and tokens served in the phase against what its limits
allow in that time, ``burst + rate × elapsed`` (GCRA's bound for any window), and its peak
of requests running at once against ``max_concurrent``.

A failure is a call that did not end OK, except the limited tenant's RESOURCE_EXHAUSTED:
that is its limits at work. Calls count in the phase in which they ended; a call that
succeeded after more than 2 s counts as *stalled* (it hung behind a stopped process).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from bench.chaos_faults import LIMITED_TENANT, Phase
from bench.chaos_load import Shot
from bench.chaos_usage import UsageCheck, UsageSnapshot, check_usage
from bench.report import pct
from common.config.access import TenantConfig
from common.tenancy.quota import request_burst, token_burst

BUCKETS: tuple[tuple[float, float, str], ...] = (
    (0.0, 0.5, "0-0.5s"),
    (0.5, 1.0, "0.5-1s"),
    (1.0, 2.0, "1-2s"),
    (2.0, math.inf, ">2s"),
)
# A usage record is flushed within 0.1 s of its call's end; a call is checked against the
# first snapshot taken at least this long after it ended.
USAGE_LAG_S = 1.5
# An OK call slower than this is counted as stalled (hung behind a stopped process).
STALL_S = 2.0


def is_failure(shot: Shot) -> bool:
    if shot.ok:
        return False
    return not (shot.tenant == LIMITED_TENANT and shot.code == "RESOURCE_EXHAUSTED")


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def latency(shots: Iterable[Shot]) -> dict[str, Any]:
    """P50/P99/max (ms) and count of the OK single-request calls among ``shots``."""
    values = [s.latency_s for s in shots if s.ok and s.requests == 1]
    return {
        "n": len(values),
        "p50_ms": ms(pct(values, 0.5)),
        "p99_ms": ms(pct(values, 0.99)),
        "max_ms": ms(max(values) if values else None),
    }


def failures(phase: Phase, shots: Sequence[Shot]) -> dict[str, Any]:
    """The phase's failed calls by time since its fault, with their codes."""
    buckets: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    late: list[dict[str, Any]] = []
    no_fault = phase.fault.action == "none"
    for shot in shots:
        if not is_failure(shot):
            continue
        since = shot.end - phase.fault_at
        label = "before" if no_fault or since < 0 else next(b[2] for b in BUCKETS if since < b[1])
        buckets[label] += 1
        codes[shot.code] += 1
        if label == ">2s" and len(late) < 20:
            late.append(
                {
                    "since_fault_s": round(since, 3),
                    "since_restored_s": round(shot.end - phase.restored_at, 3),
                    "code": shot.code,
                    "tenant": shot.tenant,
                    "kind": shot.kind,
                    "detail": shot.detail[:160],
                }
            )
    return {
        "calls": len(shots),
        "failed": sum(buckets.values()),
        "stalled": sum(1 for s in shots if s.ok and s.requests == 1 and s.latency_s > STALL_S),
        "buckets": {label: buckets[label] for label in ("before", *(b[2] for b in BUCKETS))},
        "codes": dict(codes),
        "late_examples": late,
    }


def peak_concurrency(spans: Iterable[tuple[float, float]]) -> int:
    """Most intervals open at one instant (a sweep over their ends)."""
    events = sorted(e for a, b in spans for e in ((a, 1), (b, -1)))
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def quota(tenant: TenantConfig | None, shots: Sequence[Shot], elapsed_s: float) -> dict[str, Any]:
    """What the limited tenant was served against what its limits allow in ``elapsed_s``."""
    served = sum(s.served for s in shots)
    cost = sum(s.cost for s in shots)
    out: dict[str, Any] = {
        "elapsed_s": round(elapsed_s, 2),
        "attempted": sum(s.requests for s in shots),
        "served": served,
        "refused": sum(s.refused for s in shots),
        "tokens_counted": cost,
        "peak_concurrent": peak_concurrency(span for s in shots for span in s.spans),
    }
    if tenant is None:
        return out
    if tenant.requests_per_s:
        allowed = request_burst(tenant.requests_per_s) + tenant.requests_per_s * elapsed_s
        out["allowed_requests"] = round(allowed, 1)
        out["overshoot_requests"] = round(served - allowed, 1)
    if tenant.tokens_per_min:
        allowed_t = token_burst(tenant.tokens_per_min) + tenant.tokens_per_min / 60 * elapsed_s
        out["allowed_tokens"] = round(allowed_t)
        out["overshoot_tokens"] = round(cost - allowed_t)
    out["max_concurrent"] = tenant.max_concurrent
    return out


def in_window(shots: Sequence[Shot], lo: float, hi: float, *, by: str = "end") -> list[Shot]:
    return [s for s in shots if lo <= getattr(s, by) < hi]


def by_second(calls: Sequence[Shot], since: float) -> list[dict[str, Any]]:
    """Calls by the second they began in since ``since``: how many, P50 and the slowest
    (ms), failed: where in the window the slow ones were."""
    seconds: dict[int, list[Shot]] = {}
    for shot in calls:
        seconds.setdefault(int(shot.start - since), []).append(shot)
    out = []
    for second, shots in sorted(seconds.items()):
        ms = sorted(round(s.latency_s * 1000) for s in shots)
        failed = sum(not s.ok for s in shots)
        out.append(
            {
                "s": second,
                "calls": len(ms),
                "p50_ms": ms[len(ms) // 2],
                "max_ms": ms[-1],
                "failed": failed,
            }
        )
    return out


def slow_readers(phase: Phase, good: Sequence[Shot]) -> dict[str, Any]:
    """Good traffic in the window before the unread streams and while they were open."""
    width = phase.restore_at - phase.fault_at
    before = in_window(good, phase.fault_at - width, phase.fault_at, by="start")
    during = in_window(good, phase.fault_at, phase.restore_at, by="start")
    out: dict[str, Any] = {"window_s": round(width, 2)}
    for name, calls in (("without", before), ("with", during)):
        out[name] = {**latency(calls), "ok_per_s": round(sum(s.ok for s in calls) / width, 1)}
    out["by_second"] = by_second(during, phase.fault_at)
    p99_a, p99_b = out["without"]["p99_ms"], out["with"]["p99_ms"]
    out["p99_ratio"] = round(p99_b / p99_a, 2) if p99_a and p99_b else None
    p50_a, p50_b = out["without"]["p50_ms"], out["with"]["p50_ms"]
    out["p50_ratio"] = round(p50_b / p50_a, 2) if p50_a and p50_b else None
    return out


def phase_figures(
    phase: Phase,
    shots: Sequence[Shot],
    usage_shots: Sequence[Shot],
    previous: UsageSnapshot | None,
    tenant: TenantConfig | None,
) -> dict[str, Any]:
    """Everything reported for one phase."""
    ended = in_window(shots, phase.start, phase.end)
    good = [s for s in shots if s.tenant == "demo"]
    limited = in_window(
        [s for s in shots if s.tenant == LIMITED_TENANT], phase.start, phase.end, by="start"
    )
    t0 = phase.start
    out: dict[str, Any] = {
        "fault": phase.fault.name,
        "action": phase.fault.action,
        "target": phase.fault.target,
        "note": phase.note,
        "times_s": {
            "fault": round(phase.fault_at - t0, 2),
            "restore": round(phase.restore_at - phase.fault_at, 2),
            "serving_again": round(phase.restored_at - phase.fault_at, 2),
            "end": round(phase.end - phase.fault_at, 2),
        },
        "failures": failures(phase, ended),
        # Before: calls that began and ended before the fault. After: those that ended after
        # it, so the calls it caught in flight (a stopped tier's) count.
        "latency_before": latency(
            s for s in in_window(good, phase.start, phase.fault_at) if s.start >= phase.start
        ),
        "latency_after": latency(in_window(good, phase.fault_at, phase.end)),
        "quota": quota(tenant, limited, phase.end - phase.start),
        **phase.extra,
    }
    if phase.usage is not None:
        out["usage"] = check_usage(usage_shots, phase.usage, previous).as_dict()
        multi = [s for s in usage_shots if s.kind == "multi"]
        if multi:
            out["usage_multi"] = check_usage(multi, phase.usage).as_dict()
    if phase.fault.action == "unread":
        out["slow_readers"] = slow_readers(phase, good)
    return out


def usage_windows(phases: Sequence[Phase], shots: Sequence[Shot]) -> list[list[Shot]]:
    """The calls each phase's snapshot checks: those that ended between the previous
    snapshot and this one, each at least ``USAGE_LAG_S`` before its snapshot."""
    windows, lo = [], -math.inf
    for phase in phases:
        hi = (phase.usage.taken_at if phase.usage else phase.end) - USAGE_LAG_S
        windows.append(in_window(shots, lo, hi))
        lo = hi
    return windows


def summary_usage(shots: Sequence[Shot], final: UsageSnapshot) -> UsageCheck:
    """Every call of the run against the last snapshot, taken after the load stopped."""
    return check_usage(shots, final)
