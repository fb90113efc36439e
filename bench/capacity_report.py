"""The capacity_flow report: the Markdown tables printed and written, and the JSON payload.

The Markdown has one section per measurement (propagation, Redis cost, failover, return)
under a header naming the machine, the commit and the load average; the JSON keeps every
sample and bucket of the four.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.capacity_failover import Bucket, Failover
from bench.capacity_fleet import DUBLIN, REGION, ZONE, ms
from bench.capacity_propagation import Propagation
from bench.capacity_redis_cost import RedisCost
from bench.report import pct

RESULTS = Path(__file__).resolve().parent / "results"


def _stats(values: Sequence[float]) -> str:
    if not values:
        return "— | — | —"
    return f"{ms(statistics.median(values))} | {ms(pct(values, 0.99))} | {ms(max(values))}"


def _series(rows: Sequence[Bucket]) -> str:
    return " ".join("·" if s is None else f"{s * 100:.0f}" for _, _, s, _ in rows)


def _header(info: dict[str, Any], cost: RedisCost) -> list[str]:
    return [
        "# Capacity flow and region failover",
        "",
        f"{info['date']} · {info['cpu']} · nproc {info['nproc']} · "
        f"{info['implementation']} {info['python']} · {info['platform']} · "
        f"Redis {cost.redis_version} · commit {info['commit']}"
        f"{' + uncommitted changes' if info['dirty'] else ''} · load average (1 min) "
        f"{info['loadavg_1m_start']:.2f} at start, {info['loadavg_1m_end']:.2f} at the end",
        "",
    ]


def _propagation_section(prop: Propagation, cadence_s: float) -> list[str]:
    both = prop.down_region_s + prop.up_region_s
    return [
        "## 1. Propagation of a GPU-state change to the top of the hierarchy",
        "",
        "Fleet: us-east + eu-west, 1 zone × 2 GPUs each, summary cadence "
        f"{cadence_s * 1000:.0f} ms, "
        f"health interval {cadence_s * 1000:.0f} ms. {prop.cycles} cycles: SIGKILL "
        f"`worker-{ZONE}` (both GPUs) → first entry of the stream with healthy_gpus = 0; start it "
        "again → first entry with healthy_gpus = 2, timed from the moment both GPUs answer "
        "ServerReady (10 ms poll). Read here with XREAD BLOCK; **this measures up to the region "
        "stream** — the global tier's own reader adds one XREAD round trip (≪ 1 ms on loopback).",
        "",
        "| change | n | stream | median | P99 | max |",
        "|---|---:|---|---:|---:|---:|",
        f"| GPUs die | {len(prop.down_zone_s)} | zone | {_stats(prop.down_zone_s)} |",
        f"| GPUs die | {len(prop.down_region_s)} | region | {_stats(prop.down_region_s)} |",
        f"| GPUs come back | {len(prop.up_zone_s)} | zone | {_stats(prop.up_zone_s)} |",
        f"| GPUs come back | {len(prop.up_region_s)} | region | {_stats(prop.up_region_s)} |",
        f"| **both** | {len(both)} | **region** | {_stats(both)} |",
        "",
        f"Changes not seen within the wait: {prop.missed}. Goal: ≤ 1 s P99 at the 500 ms cadence. "
        "P99 is nearest-rank: with this few samples it is the maximum. "
        f"Worker restart to ready: median {ms(statistics.median(prop.worker_start_s))}.",
        "",
    ]


def _redis_cost_section(cost: RedisCost) -> list[str]:
    per_k = 1000 / cost.gpus
    lines = [
        "## 2. Redis cost per 1000 GPUs",
        "",
        f"In-process against a fresh embedded Redis: {cost.zones} zone publishers × 8 GPUs "
        f"(= {cost.gpus} GPUs, two models per zone), {cost.regions} regional tiers (a "
        "CapacityReader over their ~8 zone streams + a region publisher each) and one global "
        f"reader over the {cost.regions} region streams; cadence {cost.cadence_s * 1000:.0f} ms, "
        f"`XADD … MAXLEN ~ {cost.maxlen}`, every stream pre-filled to MAXLEN first (the steady "
        f"state after {cost.maxlen} cadences), then measured for {cost.duration_s:.1f} s.",
        "",
        "| figure | per 1000 GPUs | per stream |",
        "|---|---:|---:|",
        f"| Redis commands/s | {cost.commands_per_s * per_k:.0f} | "
        f"{cost.commands_per_s / cost.streams:.2f} |",
    ]
    for name, rate in sorted(cost.per_command_per_s.items(), key=lambda kv: -kv[1]):
        lines.append(
            f"| · {name.upper()}/s ({cost.usec_per_call[name]:.1f} µs/call) | {rate * per_k:.1f} | "
            f"{rate / cost.streams:.2f} |"
        )
    lines += [
        f"| Redis CPU (share of one core) | "
        f"{cost.redis_cpu_share_of_one_core * per_k * 100:.1f} % | — |",
        f"| network in / out | {cost.net_in_bytes_per_s * per_k / 1024:.0f} / "
        f"{cost.net_out_bytes_per_s * per_k / 1024:.0f} KiB/s | — |",
        f"| memory held at MAXLEN (used_memory delta) | "
        f"{cost.memory_at_maxlen_bytes * per_k / 2**20:.1f} MiB | "
        f"{cost.memory_at_maxlen_bytes / cost.streams / 1024:.0f} KiB |",
        f"| memory growth during the live run | "
        f"{cost.memory_growth_live_bytes * per_k / 1024:.0f} KiB | — |",
        "",
        f"One zone stream: {cost.xlen_zone_stream} entries, "
        f"{cost.memory_zone_stream_bytes / 1024:.0f} KiB (MEMORY USAGE); one region stream "
        f"{cost.memory_region_stream_bytes / 1024:.0f} KiB. A summary is "
        f"{cost.zone_summary_bytes:.0f} B (zone) / {cost.region_summary_bytes:.0f} B (region) "
        f"serialized. Summaries delivered: {cost.regional_deliveries_per_s:.0f}/s to the regional "
        f"readers, {cost.global_deliveries_per_s:.0f}/s to the global reader.",
        "",
    ]
    return lines


def _failover_section(fo: Failover) -> list[str]:
    lines = [
        "## 3. Moving traffic when a region dies",
        "",
        f"{fo.clients} closed-loop unary clients from Dublin (`x-meridian-client-geo: {DUBLIN}`, "
        f"max_tokens {fo.max_tokens}) against the global endpoint (plaintext; tier to tier "
        f"{'mutual TLS' if fo.inner_tls else 'plaintext'}, auth off), time_scale {fo.time_scale}; "
        f"`regional-{REGION}` SIGKILLed mid-run (Fleet.kill).",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| requests (all phases) | {fo.requests} |",
        f"| before the kill: eu-west share, rate, latency P50 / P99 | "
        f"{fo.original_eu_share * 100:.0f} %, {fo.pre_kill_rps:.0f} req/s, "
        f"{ms(fo.pre_kill_latency_p50_s)} / {ms(fo.pre_kill_latency_p99_s)} |",
        f"| kill → first completion in us-east (that request started at) | "
        f"{ms(fo.first_us_east_completion_s)} ({ms(fo.first_us_east_started_s)}) |",
        "| kill → ≥ 95 % of completions in us-east (100 ms buckets, for good) | "
        f"{ms(fo.move_95_s)} |",
        f"| latency P50 / P99 while eu-west is down | "
        f"{ms(fo.down_latency_p50_s)} / {ms(fo.down_latency_p99_s)} |",
        f"| requests in flight at the kill | {fo.in_flight_at_kill} |",
        f"| failed requests, total | {fo.failed} {fo.failure_codes or ''} |",
        f"| · of them in flight at the kill | {fo.failed_in_flight_at_kill} |",
        f"| · of them started after the kill (goal 0) | {fo.failed_started_after_kill} |",
        "",
        "us-east share per 100 ms after the kill (%): " + _series(fo.move_buckets_100ms[:20]),
        "",
    ]
    if fo.failure_samples:
        lines += ["Failures seen:", ""] + [f"- `{s}`" for s in fo.failure_samples] + [""]
    return lines


def _return_section(fo: Failover) -> list[str]:
    lines = [
        "## 4. Return after the region comes back",
        "",
        f"`regional-{REGION}` started again (ready after {ms(fo.regional_start_s)}); eu-west share "
        f"of completions per 250 ms bucket from the moment it answers ServerReady "
        f"(original share {fo.original_eu_share * 100:.0f} %).",
        "",
        f"- first eu-west completion after ready: {ms(fo.first_eu_completion_after_ready_s)}",
        f"- 50 % of the original share reached at: {ms(fo.return_50_s)}; "
        f"90 %: {ms(fo.return_90_s)}",
        f"- failed requests started after ready: {fo.failed_after_ready}",
        "",
        "| t after ready | completions | eu-west share | median latency |",
        "|---:|---:|---:|---:|",
    ]
    for t, n, share, p50 in fo.return_buckets_250ms:
        cell = "—" if share is None else f"{share * 100:.0f} %"
        lines.append(f"| {t:.2f} s | {n} | {cell} | {ms(p50)} |")
    return lines


def markdown(
    info: dict[str, Any], prop: Propagation, cost: RedisCost, fo: Failover, cadence_s: float
) -> str:
    """The whole report, as printed at the end of a run and written to capacity_flow.md."""
    lines = [
        *_header(info, cost),
        *_propagation_section(prop, cadence_s),
        *_redis_cost_section(cost),
        *_failover_section(fo),
        *_return_section(fo),
    ]
    return "\n".join(lines) + "\n"


def payload(
    info: dict[str, Any], prop: Propagation, cost: RedisCost, fo: Failover
) -> dict[str, Any]:
    """What capacity_flow.json holds: the machine and every figure, sample and bucket."""
    return {
        "benchmark": "capacity_flow",
        "machine": info,
        "propagation": {
            **asdict(prop),
            "note": "measured up to the region stream; the global tier's XREAD adds one round trip",
            "region_median_s": statistics.median(prop.down_region_s + prop.up_region_s),
            "region_p99_s": pct(prop.down_region_s + prop.up_region_s, 0.99),
        },
        "redis_cost": asdict(cost),
        "failover": asdict(fo),
    }


def write(
    info: dict[str, Any], prop: Propagation, cost: RedisCost, fo: Failover, table: str
) -> None:
    """Write capacity_flow.json and capacity_flow.md (``table``, the report as printed)."""
    RESULTS.mkdir(exist_ok=True)
    data = payload(info, prop, cost, fo)
    (RESULTS / "capacity_flow.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / "capacity_flow.md").write_text(table)
    print(f"wrote {RESULTS / 'capacity_flow.json'} and {RESULTS / 'capacity_flow.md'}")
