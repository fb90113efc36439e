"""What one window measured, and its figures: pure arithmetic, no I/O.

Latency percentiles are over every request offered, a failed or timed-out one counted
as infinitely late (a front that drops its slowest requests does not look faster for
it); a percentile that lands on a failure is ``inf``. Time per output token is over the
streams that finished (it is undefined for one that did not). CPU is per request offered
and per output token delivered, over every process of the front.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

INF = math.inf


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds from its send)."""

    stream: bool
    asked_tokens: int
    ok: bool = False
    error: str = ""  # a kind: "http_503", "timeout", "connect", "short", "stream_error" …
    ttft_s: float | None = None  # first content; a unary answer's is its end
    e2e_s: float | None = None
    tokens: int = 0  # output tokens delivered (the usage's count, else content chunks)
    chunks: int = 0  # content chunks received (streams)


@dataclass
class Window:
    """One front on one workload in one round: the outcomes and the CPU they cost."""

    front: str
    workload: str
    round: int
    outcomes: list[Outcome]
    wall_s: float
    cpu_s: dict[str, float]  # per process of the front
    gpu_cpu_s: float  # the emulated GPUs' process(es), apart
    prefix_hit: float | None = None  # prompt tokens served from the GPUs' prefix caches
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank ``q``-th percentile (0-100) of ``values``, inf included; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def latencies(outcomes: Iterable[Outcome], kind: str) -> list[float]:
    """``kind`` ("e2e" or "ttft") of every outcome, a failure as ``INF``."""
    out = []
    for o in outcomes:
        value = o.e2e_s if kind == "e2e" else o.ttft_s
        out.append(value if o.ok and value is not None else INF)
    return out


def tpot(outcome: Outcome) -> float | None:
    """A finished stream's time per output token after the first; None otherwise."""
    if not (outcome.ok and outcome.stream) or outcome.tokens < 2:
        return None
    assert outcome.e2e_s is not None and outcome.ttft_s is not None
    return (outcome.e2e_s - outcome.ttft_s) / (outcome.tokens - 1)


def cpu_per(cpu_s: float, requests: int, tokens: int) -> tuple[float | None, float | None]:
    """(ms per request, µs per output token) of ``cpu_s``; None where nothing was counted."""
    per_request = 1e3 * cpu_s / requests if requests else None
    per_token = 1e6 * cpu_s / tokens if tokens else None
    return per_request, per_token


def _ms(value: float | None) -> float | None:
    if value is None:
        return None
    return value * 1e3 if math.isfinite(value) else INF


def summary(window: Window) -> dict[str, Any]:
    """The window's figures (the JSON row; latencies in ms, ``inf`` for a failure)."""
    outs = window.outcomes
    ok = [o for o in outs if o.ok]
    tokens = sum(o.tokens for o in ok)
    cpu = sum(window.cpu_s.values())
    per_request, per_token = cpu_per(cpu, len(outs), tokens)
    e2e, ttft = latencies(outs, "e2e"), latencies(outs, "ttft")
    tpots = [t for t in (tpot(o) for o in outs) if t is not None]
    streams = [o for o in ok if o.stream]
    return {
        "front": window.front,
        "workload": window.workload,
        "round": window.round,
        "offered": len(outs),
        "ok": len(ok),
        "errors": dict(Counter(o.error for o in outs if not o.ok)),
        "output_tokens": tokens,
        "chunks_per_stream": statistics.mean(o.chunks for o in streams) if streams else None,
        "wall_s": window.wall_s,
        "cpu_s": window.cpu_s,
        "cpu_ms_per_request": per_request,
        "cpu_us_per_token": per_token,
        "cores": cpu / window.wall_s if window.wall_s else None,
        "gpu_cpu_ms_per_request": cpu_per(window.gpu_cpu_s, len(outs), tokens)[0],
        "prefix_hit": window.prefix_hit,
        "e2e_p50_ms": _ms(percentile(e2e, 50)),
        "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpots, 50)),
        "tpot_p99_ms": _ms(percentile(tpots, 99)),
        **window.extra,
    }


FIGURES = (
    "cpu_ms_per_request",
    "net_cpu_ms_per_request",
    "cpu_us_per_token",
    "cores",
    "gpu_cpu_ms_per_request",
    "prefix_hit",
    "chunks_per_stream",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
)


def median_of(values: Iterable[float | None]) -> float | None:
    """The median over rounds (``inf`` sorts last); None when no round measured it."""
    got = sorted(v for v in values if v is not None)
    if not got:
        return None
    mid = len(got) // 2
    if len(got) % 2:
        return got[mid]
    low, high = got[mid - 1], got[mid]
    return INF if INF in (low, high) else (low + high) / 2


def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One front's figures on one workload: each the median over its rounds; errors summed."""
    errors: Counter[str] = Counter()
    for row in rows:
        errors.update(row["errors"])
    out: dict[str, Any] = {f: median_of(r.get(f) for r in rows) for f in FIGURES}
    out.update(
        rounds=len(rows),
        offered=sum(r["offered"] for r in rows),
        ok=sum(r["ok"] for r in rows),
        errors=dict(errors),
    )
    return out


def ratios(rows: list[dict[str, Any]], peers: Sequence[str], figure: str) -> dict[str, Any]:
    """Per front, the median over rounds of its ``figure`` over the best (lowest) peer's in
    the same round; None for a round where either is missing or the best is not finite."""
    by_round: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["front"]] = row[figure]
    out: dict[str, list[float | None]] = {}
    for fronts in by_round.values():
        best = min((v for f, v in fronts.items() if f in peers and v is not None), default=None)
        for front, value in fronts.items():
            ok = value is not None and best is not None and 0 < best < INF
            out.setdefault(front, []).append(value / best if ok else None)
    return {front: median_of(values) for front, values in out.items()}
