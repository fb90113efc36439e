"""The fairness bench's report: the progress lines, the Markdown table and the JSON payload.

``decomposition`` splits steady's contended latency into what it pays alone, the GPU's
slowdown (from ``sim.engine``'s cost model at the measured batch and prefill share), the
measured wait in the central queue, and what is left over.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bench.fairness_load import PROMPT_WORDS
from bench.fairness_phases import Phase, Rig, Stream
from bench.fairness_zone import MODEL
from sim.engine import DECODE_STEP_BASE_S, DECODE_STEP_PER_SEQ_S


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def describe(phase: Phase) -> str:
    s = phase.steady
    line = (
        f"    steady P50 {_ms(s.p50_ms)} ms, P99 {_ms(s.p99_ms)} ms, {s.codes}; "
        f"its queue wait P50 {_ms(phase.steady_queue_wait_p50_ms)} ms, "
        f"P99 {_ms(phase.steady_queue_wait_p99_ms)} ms\n"
        f"    GPU batch {phase.mean_gpu_batch:.1f}, GPU FIFO {phase.mean_gpu_fifo:.1f}, "
        f"prefill {100 * phase.gpu_prefill_share:.0f} % of GPU time, "
        f"queue {phase.mean_queue_depth:.0f}, loop lag P99 {phase.loop_lag_p99_ms:.1f} ms, "
        f"cpu {phase.process_cpu_cores:.2f} cores"
    )
    if phase.flood is not None:
        line += (
            f"\n    flood sent {phase.flood.sent}: {phase.flood.codes}; from the queue: "
            f"{phase.flood_granted} granted, {phase.flood_expired_in_queue} expired"
        )
    return line


def ratio(phase: Phase, alone: Phase) -> float | None:
    if phase.steady.p99_ms is None or not alone.steady.p99_ms:
        return None
    return phase.steady.p99_ms / alone.steady.p99_ms


def decode_ms(batch: float, tokens: int, time_scale: float) -> float:
    """The emulated A100's decode time for ``tokens`` at a steady ``batch`` (sim.engine)."""
    return 1000 * tokens * (DECODE_STEP_BASE_S + DECODE_STEP_PER_SEQ_S * batch) * time_scale


def decomposition(rig: Rig, index: int) -> list[tuple[str, float | None, float | None]]:
    """Steady's contended latency as alone + the GPU's slowdown + queue wait + the rest.

    The GPU's part follows ``sim.engine``'s cost model: each decode step takes longer
    with a larger batch, and a step that admits requests also prefills their prompts,
    stalling every sequence in the batch (no chunked prefill), so a request's decode
    time stretches by 1 / (1 - share of GPU time spent prefilling)."""
    alone, contended = rig.phases[0], rig.phases[index]
    tokens, scale = rig.args.max_tokens, rig.args.time_scale
    decode_a = decode_ms(alone.mean_gpu_batch, tokens, scale)
    decode_c = decode_ms(contended.mean_gpu_batch, tokens, scale)
    pa, pc = alone.gpu_prefill_share, contended.gpu_prefill_share
    prefill = decode_c * pc / (1 - pc) - decode_a * pa / (1 - pa)
    rows: list[tuple[str, float | None, float | None]] = [
        ("steady alone", alone.steady.p50_ms, alone.steady.p99_ms),
        (
            f"+ decode at GPU batch {contended.mean_gpu_batch:.1f} instead of "
            f"{alone.mean_gpu_batch:.1f} ({tokens} steps)",
            decode_c - decode_a,
            decode_c - decode_a,
        ),
        (
            f"+ other requests' prefill stalling the batch ({100 * pc:.0f} % of GPU time "
            f"instead of {100 * pa:.0f} %)",
            prefill,
            prefill,
        ),
        (
            "+ wait in the central queue (measured)",
            contended.steady_queue_wait_p50_ms,
            contended.steady_queue_wait_p99_ms,
        ),
    ]

    def rest(total: float | None, parts: list[float | None]) -> float | None:
        known = [v for v in parts if v is not None]
        return None if total is None or len(known) < len(parts) else total - sum(known)

    rows.append(
        (
            "+ the rest (difference)",
            rest(contended.steady.p50_ms, [row[1] for row in rows]),
            rest(contended.steady.p99_ms, [row[2] for row in rows]),
        )
    )
    rows.append(("= steady contended", contended.steady.p50_ms, contended.steady.p99_ms))
    return rows


def markdown(rig: Rig, info: dict[str, Any], target: float) -> str:
    lines = [
        *_intro(rig, info),
        "",
        *_latency_table(rig.phases),
        "",
        *_outcomes_table(rig.phases),
        "",
        *_verdict(rig.phases, target),
        *_decompositions(rig),
        "",
        "Diagnosis and what would fix it: `bench/README.md` (fairness).",
    ]
    return "\n".join(lines) + "\n"


def _intro(rig: Rig, info: dict[str, Any]) -> list[str]:
    args = rig.args
    return [
        "# Tenant fairness in the local tier's central queue",
        "",
        f"{info['date']} · {info['cpu']} · nproc {info['nproc']} · "
        f"{info['implementation']} {info['python']} · commit {info['commit']}"
        f"{' (uncommitted changes)' if info['dirty'] else ''} · load avg "
        f"{info['loadavg_1m_start']:.1f} → {info['loadavg_1m_end']:.1f}",
        "",
        f"One local tier in-process over {args.gpus} emulated A100s × {args.slots} slots "
        f"(time scale {args.time_scale:g}), requests of {PROMPT_WORDS} prompt + "
        f"{args.max_tokens} new tokens sent straight to its V2 endpoint. Capacity "
        f"C = **{rig.capacity_rps:.1f} requests/s** (closed loop, every slot busy). "
        f"`steady` sends Poisson at {args.steady_share:g} × C (deadline "
        f"{args.steady_deadline_s:g} s unless the run says otherwise); `flood` sends Poisson at "
        f"{args.flood_x:g} × its fair share (C / 2) with a {args.flood_deadline_s:g} s deadline, "
        f"from {args.flood_lead_s:g} s before steady's first request until its last. Both "
        "tenants weigh 1. *No fairness*: both streams send the same tenant id, so the queue is "
        "one FIFO. Latency from each request's scheduled send time, OK requests only.",
    ]


def _latency_table(phases: list[Phase]) -> list[str]:
    alone = phases[0]
    lines = [
        "| run | headroom | steady sent | steady P50 ms | steady P99 ms | P99 / alone | "
        "steady queued | its queue wait P50 / P99 ms | zone OK/s | GPU batch | GPU prefill | "
        "GPU FIFO | queue depth | loop lag P99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        r = ratio(p, alone)
        queued = "—" if p.steady_queued is None else str(p.steady_queued)
        lines.append(
            f"| {p.name} | {p.headroom:g} | {p.steady.sent} | {_ms(p.steady.p50_ms)} | "
            f"{_ms(p.steady.p99_ms)} | {'—' if r is None else f'{r:.2f}'} | {queued} | "
            f"{_ms(p.steady_queue_wait_p50_ms)} / {_ms(p.steady_queue_wait_p99_ms)} | "
            f"{p.zone_ok_rps:.1f} | {p.mean_gpu_batch:.1f} | {100 * p.gpu_prefill_share:.0f} % | "
            f"{p.mean_gpu_fifo:.1f} | {p.mean_queue_depth:.0f} | "
            f"{p.loop_lag_p99_ms:.1f} |"
        )
    return lines


def _outcomes_table(phases: list[Phase]) -> list[str]:
    lines = [
        "Outcomes (gRPC status: count). *Granted* / *expired*: flood requests that got a slot "
        "from the central queue / whose deadline passed waiting in it.",
        "",
        "| run | steady | flood sent | flood | flood granted | flood expired |",
        "|---|---|---:|---|---:|---:|",
    ]
    for p in phases:
        flood = p.flood
        lines.append(
            f"| {p.name} | {_codes(p.steady)} | {flood.sent if flood else 0} | "
            f"{_codes(flood) if flood else '—'} | {_count(p.flood_granted)} | "
            f"{_count(p.flood_expired_in_queue)} |"
        )
    return lines


def _verdict(phases: list[Phase], target: float) -> list[str]:
    alone = phases[0]
    r = ratio(phases[1], alone)
    verdict = "met" if r is not None and r <= target else "missed"
    return [
        f"**Steady P99 contended / alone = {'—' if r is None else f'{r:.2f}'}** "
        f"(target ≤ {target:g}: {verdict}); without fairness "
        f"{_ratio(ratio(phases[3], alone))}.",
        "",
        "Where steady's extra latency comes from. The GPU rows follow the emulated GPU's "
        "cost model (`sim.engine`) at the measured mean batch and prefill share; the queue "
        "row is measured; percentiles of parts do not add exactly, and *the rest* is what "
        "is left (GPU FIFO behind slots still held by cancelled requests, gRPC, event loop):",
    ]


def _decompositions(rig: Rig) -> list[str]:
    lines: list[str] = []
    for index in (1, 2):
        lines += [
            "",
            f"*{rig.phases[index].name}*:",
            "",
            "| | P50 ms | P99 ms |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {name} | {_ms(p50)} | {_ms(p99)} |" for name, p50, p99 in decomposition(rig, index)
        ]
    return lines


def _codes(stream: Stream) -> str:
    return ", ".join(f"{code} {n}" for code, n in stream.codes.items()) or "—"


def _count(value: int | None) -> str:
    return "—" if value is None else str(value)


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def payload(rig: Rig, info: dict[str, Any]) -> dict[str, Any]:
    """What ``bench/results/fairness.json`` holds (``bench.before_after`` reads its ratios)."""
    alone = rig.phases[0]
    return {
        "benchmark": "fairness",
        "machine": info,
        "config": {**vars(rig.args), "prompt_words": PROMPT_WORDS, "model": MODEL},
        "capacity_rps": rig.capacity_rps,
        "phases": [asdict(p) for p in rig.phases],
        "p99_ratio_contended_vs_alone": ratio(rig.phases[1], alone),
        "p99_ratio_vtc_only_vs_alone": ratio(rig.phases[2], alone),
        "p99_ratio_no_fairness_vs_alone": ratio(rig.phases[3], alone),
        "decomposition_ms": {
            rig.phases[index].name: [
                {"part": name, "p50": p50, "p99": p99}
                for name, p50, p99 in decomposition(rig, index)
            ]
            for index in (1, 2)
        },
        "target": rig.args.target,
    }
