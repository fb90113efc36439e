"""The tables of ``bench.stream_cost``: medians over rounds, ratios against ``before``."""

from __future__ import annotations

import statistics
from typing import Any


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over rounds per (variant, protocol, streams), ratios against ``before``."""
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in results:
        rows.setdefault((r["variant"], r["protocol"], r["streams"]), []).append(r)
    out = []
    for (variant, protocol, streams), rounds in rows.items():

        def med(key: str, rounds: list[dict[str, Any]] = rounds) -> float:
            return statistics.median(r[key] for r in rounds)

        out.append(
            {
                "variant": variant,
                "protocol": protocol,
                "streams": streams,
                "requests_per_s": statistics.median(r["requests"] / r["wall_s"] for r in rounds),
                "errors": sum(r["errors"] for r in rounds),
                "tokens_per_request": med("tokens_per_request"),
                "messages_per_request": med("messages_per_request"),
                "front_ms_per_request": med("front_ms_per_request"),
                "front_us_per_token": med("front_us_per_token"),
                "front_cores": med("front_cores"),
            }
        )
    base = {(r["protocol"], r["streams"]): r for r in out if r["variant"] == "before"}
    for r in out:
        b = base.get((r["protocol"], r["streams"]))
        r["x_before"] = r["front_ms_per_request"] / b["front_ms_per_request"] if b else None
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# stream_cost: CPU per streamed request through the whole chain",
        "",
        f"Run {m['when']} on {m['cpus']} cores ({m['platform']}), load average "
        f"{m['load_start']} at start, {m['load_end']} at end; commit {m['commit']}, "
        f"before = {result['before']}, after = {result['after']}. Other engineers' "
        "CPU-heavy work shared the "
        "machine: figures move between runs by tens of percent; compare rows of one run.",
        "",
        f"Command: `{result['command']}`",
        "",
        "Front = global + regional + local + Redis (the emulated GPUs apart). "
        f"{result['args']['tokens']}-token requests, closed loops of N concurrent streams, "
        f"medians of {result['args']['rounds']} windows of {result['args']['seconds']:g} s.",
        "",
        "| variant | protocol | streams | req/s | messages/req | tokens/req | "
        "front ms CPU/req | front µs CPU/token | front cores | × before | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = "" if r["x_before"] is None else f"{r['x_before']:.2f}"
        lines.append(
            f"| {r['variant']} | {r['protocol']} | {r['streams']} | {r['requests_per_s']:.1f} "
            f"| {r['messages_per_request']:.1f} | {r['tokens_per_request']:.1f} "
            f"| {r['front_ms_per_request']:.2f} | {r['front_us_per_token']:.0f} "
            f"| {r['front_cores']:.2f} | {ratio} | {r['errors']} |"
        )
    return "\n".join(lines) + "\n"
