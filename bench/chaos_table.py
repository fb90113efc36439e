"""The chaos bench's printed report: one row per fault, then the abuse cases and the run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _num(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        value = f"{value:.0f}" if abs(value) >= 10 else f"{value:.1f}"
    return f"{value}{unit}"


def _signed(quota: dict[str, Any]) -> str:
    over = quota.get("overshoot_requests")
    return ("+" if over is not None and over > 0 else "") + _num(over)


def _codes(codes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(codes.items(), key=lambda kv: -kv[1])) or "—"


def fault_rows(phases: Sequence[dict[str, Any]]) -> list[str]:
    head = (
        f"{'fault':<17} {'calls':>6} {'before':>6} {'0-0.5s':>6} {'0.5-1s':>6} {'1-2s':>5} "
        f"{'>2s':>5} {'stall':>5}  {'P99 ms before→after':>20}  {'usage lost/dbl/erased':>21}  "
        f"{'limited served/allowed':>22} {'peak':>5}  codes"
    )
    lines = [head, "-" * len(head)]
    for p in phases:
        f, b = p["failures"], p["failures"]["buckets"]
        usage = p.get("usage") or {}
        q = p["quota"]
        p99 = f"{_num(p['latency_before']['p99_ms'])} → {_num(p['latency_after']['p99_ms'])}"
        lost = f"{usage.get('lost', '—')}/{usage.get('doubled', '—')}/{usage.get('erased', '—')}"
        limited = f"{q['served']}/{_num(q.get('allowed_requests'))} ({_signed(q)})"
        peak = f"{q['peak_concurrent']}/{_num(q.get('max_concurrent'))}"
        lines.append(
            f"{p['fault']:<17} {f['calls']:>6} {b['before']:>6} {b['0-0.5s']:>6} "
            f"{b['0.5-1s']:>6} {b['1-2s']:>5} {b['>2s']:>5} {f['stalled']:>5}  {p99:>20}  "
            f"{lost:>21}  {limited:>22} {peak:>5}  {_codes(f['codes'])}"
        )
    return lines


def slow_reader_lines(phase: dict[str, Any]) -> list[str]:
    sr = phase["slow_readers"]
    a, b = sr["without"], sr["with"]
    ended = phase.get("ended_by_server") or {}
    return [
        f"slow readers: {phase.get('streams')} unread streams ({phase['note']}), "
        f"{sr['window_s']} s windows of good traffic in the same run:",
        f"  without: P50 {_num(a['p50_ms'])} ms  P99 {_num(a['p99_ms'])} ms  {a['ok_per_s']} OK/s",
        f"  with:    P50 {_num(b['p50_ms'])} ms  P99 {_num(b['p99_ms'])} ms  "
        f"{b['ok_per_s']} OK/s   P99 ratio {_num(sr['p99_ratio'])}× "
        f"(goal ≤ 2×), P50 ratio {_num(sr['p50_ratio'])}×",
        f"  streams the server ended before the bench closed them: {_codes(ended)}",
        "  good calls by the second they began after the streams opened (calls, P50/max ms, "
        "failed): "
        + ", ".join(
            f"{b['s']}s {b['calls']} {b['p50_ms']}/{b['max_ms']}"
            + (f" ×{b['failed']}" if b["failed"] else "")
            for b in sr.get("by_second", [])
        ),
        *(
            f"  GPU slots {when}: {g.get('held')} of {g.get('slots')} held by the local tiers, "
            f"{g.get('running')} sequences running on the GPUs, {g.get('queued')} queued"
            for when, g in (phase.get("gpu_slots") or {}).items()
        ),
    ]


def tenant_stream_lines(phase: dict[str, Any]) -> list[str]:
    q = phase["quota"]
    um = phase.get("usage_multi") or {}
    return [
        f"limited tenant's multi-request streams ({phase['note']}, max_tokens "
        f"{phase.get('max_tokens')}, stream: false), plus its unary probe, in "
        f"{q['elapsed_s']} s:",
        f"  requests sent {q['attempted']}, served {q['served']}, refused {q['refused']}; "
        f"its limits allow {_num(q.get('allowed_requests'))} requests "
        f"(overshoot {_num(q.get('overshoot_requests'))}) and "
        f"{_num(q.get('allowed_tokens'))} tokens (counted {q['tokens_counted']}, overshoot "
        f"{_num(q.get('overshoot_tokens'))}); peak running at once {q['peak_concurrent']} "
        f"(max_concurrent {_num(q.get('max_concurrent'))})",
        f"  usage of the streams: {um.get('served', '—')} requests served, "
        f"{um.get('billed', '—')} OK records (lost {um.get('lost', '—')}); "
        f"{um.get('tokens_served', '—')} completion tokens served, "
        f"{um.get('tokens_billed', '—')} billed",
    ]


def cpu_lines(cpu: dict[str, Any]) -> list[str]:
    cores = cpu["cores"]
    return [
        f"CPU over the run ({cpu['wall_s']:.0f} s, {cpu['nproc']} cores, load average "
        f"{cpu['loadavg_start']} → {cpu['loadavg_end']}): the router's tiers "
        f"{cores['router']:.2f} cores, the emulated GPUs {cores['gpus']:.2f}, Redis "
        f"{cores['redis']:.2f}, this load generator {cores['bench']:.2f}.",
        "  The emulated GPUs and the load generator share those cores with the router, so "
        "every latency above includes",
        "  CPU queueing behind them; compare figures within one run, not across machines.",
    ]


def render(result: dict[str, Any]) -> str:
    phases = result["phases"]
    lines = [
        f"chaos bench ({result['config']['mode']}): {result['config']['concurrency']} good "
        f"callers (tenant demo, {result['config']['stream_share']:.0%} token streams) from "
        f"{len(result['config']['cities'])} cities, deadline {result['config']['timeout_s']} s;"
        f" the limited tenant {result['config']['limited_tenant']} probing its quota",
        "failed calls by time from the fault to the failure (goal: none after 2 s), OK calls "
        "slower than 2 s (stall); usage records checked per call by trace id",
        "",
        *fault_rows(phases),
        "",
    ]
    for phase in phases:
        if "slow_readers" in phase:
            lines += [*slow_reader_lines(phase), ""]
        if phase["action"] == "streams":
            lines += [*tenant_stream_lines(phase), ""]
    run = result["run_usage"]
    lines.append(
        f"usage over the whole run (every call against the last snapshot): {run['served']} "
        f"requests served, {run['billed']} OK records; lost {run['lost']}, doubled "
        f"{run['doubled']}, phantom {run['phantom']}, failed or refused calls without a record "
        f"{run['unserved_unrecorded']}, re-written entries {run['rewritten']}"
    )
    lines += ["", *cpu_lines(result["cpu"])]
    lines += [f"excluded: {x}" for x in result["excluded"]]
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The printed report in a Markdown page, with what it ran on."""
    m, r = result["machine"], result["revision"]
    return "\n".join(
        [
            "# chaos — faults under load against a `meridian up` fleet",
            "",
            f"`{result['config']['command']}` at commit {r['commit']}"
            f"{' (uncommitted changes)' if r['dirty'] else ''}, {m['date']}, {m['nproc']} × "
            f"{m['cpu']}, Python {m['python']}. Every figure is in the JSON of the same name "
            "beside this file; `bench/README.md` says what they mean.",
            "",
            "```",
            render(result),
            "```",
            "",
        ]
    )
