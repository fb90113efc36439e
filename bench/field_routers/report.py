"""The figures over rounds, the ratios to the best Rust router, and the Markdown."""

from __future__ import annotations

import math
from typing import Any

from bench.field_routers.fronts import RUST
from bench.field_routers.stats import medians, ratios

RATIO_FIGURES = ("cpu_ms_per_request", "cpu_us_per_token", "ttft_p99_ms", "e2e_p99_ms")


def aggregate(rows: list[dict[str, Any]], fronts: list[str]) -> dict[str, Any]:
    """Per workload: each front's medians over rounds, and per figure of ``RATIO_FIGURES``
    its ratio to the best Rust router of the same round (median over rounds)."""
    out: dict[str, Any] = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        per_front = {
            f: medians([r for r in mine if r["front"] == f])
            for f in fronts
            if any(r["front"] == f for r in mine)
        }
        out[workload] = {
            "fronts": per_front,
            "vs_best_rust": {fig: ratios(mine, RUST, fig) for fig in RATIO_FIGURES},
        }
    return out


def finite(value: Any) -> Any:
    """JSON without Infinity: ``inf`` as the string "inf", recursively."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"{value:,.{digits}f}"


def _ratio(value: Any) -> str:
    return "" if value is None else f" ({_num(value, 2)}×)"


def table(workload: str, agg: dict[str, Any]) -> list[str]:
    vs = agg["vs_best_rust"]
    lines = [
        f"### {workload}",
        "",
        "| front | CPU ms/req | net of idle | CPU µs/token | TTFT P50 / P99 ms | TPOT P50 / P99 ms "
        "| e2e P50 / P99 ms | errors | prefix hit | GPUs' CPU ms/req |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for front, m in agg["fronts"].items():
        errors = ", ".join(f"{k} {v}" for k, v in m["errors"].items()) or "0"
        lines.append(
            f"| {front} "
            f"| {_num(m['cpu_ms_per_request'], 2)}{_ratio(vs['cpu_ms_per_request'].get(front))} "
            f"| {_num(m.get('net_cpu_ms_per_request'), 2)} "
            f"| {_num(m['cpu_us_per_token'])}{_ratio(vs['cpu_us_per_token'].get(front))} "
            f"| {_num(m['ttft_p50_ms'])} / {_num(m['ttft_p99_ms'])}"
            f"{_ratio(vs['ttft_p99_ms'].get(front))} "
            f"| {_num(m['tpot_p50_ms'], 1)} / {_num(m['tpot_p99_ms'], 1)} "
            f"| {_num(m['e2e_p50_ms'])} / {_num(m['e2e_p99_ms'])}"
            f"{_ratio(vs['e2e_p99_ms'].get(front))} "
            f"| {errors} of {m['offered']} | {_num(m['prefix_hit'], 2)} "
            f"| {_num(m['gpu_cpu_ms_per_request'], 2)} |"
        )
    return [*lines, ""]


def markdown(result: dict[str, Any]) -> str:
    m, load, shape = result["machine"], result["load"], result["shape"]
    rev = result["revision"]
    api = "chat" if result["args"]["api"] == "chat" else "text"
    lines = [
        "# The field's LLM routers beside Meridian (bench/field_routers)",
        "",
        f"`{result['command']}` at {rev.get('commit', '?')}"
        f"{' (tree dirty)' if rev.get('dirty') else ''}, {m['date']}; {m['nproc']} cores "
        f"({m['cpu']}), load average {m['load_start']} at start, {m['load_end']} at end. "
        "Every process (fronts, the emulated GPUs, the client) shares these cores, and so "
        "does other work on the machine.",
        "",
        f"{result['args']['gpus']} emulated H100s (`meridian worker`, OpenAI HTTP, one "
        f"process, time scale {result['args']['time_scale']}) behind every front; "
        f"open-loop {api} completions at {load['rate_rps']:.1f} req/s = "
        f"{result['args']['load']:.0%} of the GPUs' computed capacity with every shared "
        f"prefix and earlier turn cached ({load['capacity_rps']:.1f} req/s; prefix hit "
        "below says how much was), "
        f"{shape['seconds']:.0f} s of arrivals per "
        f"window, {result['args']['rounds']} rounds, fronts rotated per round; "
        f"{shape['prefixes']} shared system prompts of {shape['prefix_words']} tokens, "
        f"{load['mean_turns_per_conversation']:.1f} turns per conversation, prompts of "
        f"{load['mean_prompt_tokens']:.0f} tokens and answers of "
        f"{load['mean_output_tokens']:.0f} on average.",
        "",
        "Figures are medians over rounds. CPU: utime + stime of every process of the "
        "front (meridian: global + regional + local + Redis; meridian-local: local + "
        "Redis; meridian-envoy: Envoy + local + Redis; a Rust router: its process) over "
        "the window, per request offered and per output token delivered; the GPUs' own "
        "CPU apart. Latency percentiles are over "
        "every request offered, a failure counted as infinitely late (∞). (N×): the "
        "ratio to the best Rust router's figure in the same round.",
        "",
    ]
    if result["args"]["api"] != "chat":
        lines += [
            "Text completions, the conversation rendered as the emulated GPU renders a chat "
            "(`--api chat` sends it to `/v1/chat/completions`, where SMG and sglang-router "
            "forward `max_tokens` as `max_completion_tokens`).",
            "",
        ]
    idle = result.get("idle_cores") or {}
    if idle:
        shares = ", ".join(f"{f} {100 * c:.2f} %" for f, c in idle.items())
        lines += [
            "Idle, with no traffic, each front's processes use (of a core): "
            f"{shares}; 'net of idle' takes that out of the CPU per request.",
            "",
        ]
    for name, why in result["missing"].items():
        lines += [f"**{name}**: {why}", ""]
    for workload, agg in result["summary"].items():
        lines += table(workload, agg)
    return "\n".join(lines)
