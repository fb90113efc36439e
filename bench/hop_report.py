"""The Markdown page of ``bench.hop_cost``: each tier against the bare hop in its position."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tier target, its bare peer, the process measured at that position in each
PAIRS = (
    ("local", "bare1", "local-us-east-1a", "bare-local"),
    ("regional", "bare2", "regional-us-east", "bare-regional"),
    ("chain", "bare3", "global", "bare-global"),
)


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "—" if value is None else format(value, spec)


def _rows(m: dict[str, Any]) -> list[str]:
    direct = (m.get("direct") or {}).get("p50_ms")
    rows = []
    for name, r in m.items():
        net = r.get("net_cpu_us_per_request", {})
        cpu = ", ".join(
            f"{p} {v:.0f}" + (f" ({net[p]:.0f})" if p in net else "")
            for p, v in r["cpu_us_per_request"].items()
        )
        added = None if direct is None or r["p50_ms"] is None else r["p50_ms"] - direct
        rows.append(
            f"| {name} | {_fmt(r['rps'])} | {_fmt(r['p50_ms'], '.1f')} | "
            f"{_fmt(added, '.1f')} | {r['errors']} | {cpu} |"
        )
    return rows


def ratios(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Per tier: requests/s over its bare peer's, CPU per request over the bare hop's at
    the same position, latency added over the bare hop's (both from ``direct``)."""
    out = []
    direct = (m.get("direct") or {}).get("p50_ms")
    for tier, bare, proc, bare_proc in PAIRS:
        if tier not in m or bare not in m:
            continue
        t, b = m[tier], m[bare]
        cpu_t, cpu_b = t["cpu_us_per_request"][proc], b["cpu_us_per_request"][bare_proc]
        net_t = t.get("net_cpu_us_per_request", {}).get(proc)
        net_b = b.get("net_cpu_us_per_request", {}).get(bare_proc)
        net_ratio = net_t / net_b if net_t and net_b else None
        lat = None
        if direct is not None and t["p50_ms"] and b["p50_ms"] and b["p50_ms"] > direct:
            lat = (t["p50_ms"] - direct) / (b["p50_ms"] - direct)
        out.append(
            {
                "tier": tier,
                "rps_ratio": t["rps"] / b["rps"],
                "process": proc,
                "cpu_us": cpu_t,
                "bare_cpu_us": cpu_b,
                "cpu_ratio": cpu_t / cpu_b,
                "net_cpu_us": net_t,
                "net_cpu_ratio": net_ratio,
                "added_latency_ratio": lat,
            }
        )
    return out


def markdown(result: dict[str, Any], results_dir: Path) -> str:
    p = result["params"]
    m = result["median"]
    lines = [
        f"# Hop cost — `python -m bench.hop_cost` (results/{p['out']})",
        "",
        f"{result['machine']['cpus']} CPUs, Python {result['machine']['python']}; TLS between "
        f"tiers {'on' if result['tls'] else 'off'}; OTEL env {result['otel_env'] or 'unset'}; "
        f"{p['gpus']} emulated GPUs at time scale {p['time_scale']}; closed loop of "
        f"{p['concurrency']}, {p['seconds']} s per target, {p['rounds']} interleaved rounds "
        "(medians). CPU µs/request from /proc/PID/stat of each process on the path; in "
        "brackets, net of what the process burns idle over the same time (idle CPU ms/s: "
        + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in result.get("idle_cpu_s_per_s", {}).items())
        + ").",
        "",
        "| target | req/s | p50 ms | p50 added vs direct | errors | CPU µs/request (net of idle) |",
        "|---|---|---|---|---|---|",
        *_rows(m),
        "",
        "| tier | req/s ÷ bare | CPU µs/req (tier / bare) | CPU ÷ bare | net CPU ÷ bare "
        "| added p50 ÷ bare |",
        "|---|---|---|---|---|---|",
    ]
    for r in ratios(m):
        lines.append(
            f"| {r['tier']} ({r['process']}) | {r['rps_ratio']:.2f} | "
            f"{r['cpu_us']:.0f} / {r['bare_cpu_us']:.0f} | {r['cpu_ratio']:.2f} | "
            f"{_fmt(r['net_cpu_ratio'], '.2f')} | "
            f"{_fmt(r['added_latency_ratio'], '.2f')} |"
        )
    before = results_dir / "hop_cost_before.json"
    if p["out"] != "hop_cost_before" and before.is_file():
        old = {r["tier"]: r for r in ratios(json.loads(before.read_text())["median"])}
        lines += [
            "",
            "Before (main's code, `results/hop_cost_before.json`) → now:",
            "",
            "| tier | CPU µs/req before → now | CPU ÷ bare before → now |",
            "|---|---|---|",
        ]
        for r in ratios(m):
            o = old.get(r["tier"])
            if o:
                lines.append(
                    f"| {r['tier']} | {o['cpu_us']:.0f} → {r['cpu_us']:.0f} | "
                    f"{o['cpu_ratio']:.2f} → {r['cpu_ratio']:.2f} |"
                )
    return "\n".join(lines) + "\n"
