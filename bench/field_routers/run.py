"""The rounds: every front, every workload, the same arrivals, interleaved.

Round ``r`` builds one schedule per workload (seed ``seed + r``) and offers it to every
available front, the fronts' order rotated by one each round so that no front always
runs first (or right after the heaviest one): noise from the rest of the machine falls
on all of them alike. Before each window the GPUs must be idle (nothing running or
queued); each window gets a salt of its own (``workload.salted``), so prefix caches
start cold for every front. CPU is read from /proc for every process of the front from
the first send to the last answer; the GPUs' worker apart.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.field_routers.client import offer
from bench.field_routers.fronts import Stage, gpu_counters, process_tree_cpu, wait_gpus_idle
from bench.field_routers.stats import Window, summary
from bench.field_routers.workload import Shape, Turn, schedule

HIT = "meridian_sim_prefix_cache_hit_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
GENERATED = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class Plan:
    """What to run: the workloads by name (stream share) and the window's shape."""

    shape: Shape
    workloads: dict[str, float]  # name: share of requests streamed
    rounds: int
    seed: int
    timeout_s: float
    api: str = "completions"  # or "chat" (client.PATHS)
    warmup_requests: int = 16


def rotated(fronts: list[str], by: int) -> list[str]:
    """``fronts`` rotated left by ``by`` (round ``by``'s order)."""
    if not fronts:
        return []
    k = by % len(fronts)
    return fronts[k:] + fronts[:k]


def window(
    stage: Stage, front: str, workload: str, rnd: int, turns: list[Turn], salt: str, plan: Plan
) -> Window:
    """Offer ``turns`` to ``front``; the outcomes and what they cost."""
    urls = stage.gpu_urls()
    if not wait_gpus_idle(urls, 120):
        print(f"warning: GPUs still busy before {front}/{workload}", file=sys.stderr)
    pids = stage.pids(front)
    gpu_pid = stage.gpu_pid()
    before_gpu = gpu_counters(urls)
    before = {n: process_tree_cpu(p) for n, p in pids.items()}
    gpu_before = process_tree_cpu(gpu_pid)
    started, client_before = time.perf_counter(), time.process_time()
    outcomes = asyncio.run(offer(stage.available[front], turns, salt, plan.timeout_s, plan.api))
    wall = time.perf_counter() - started
    client_cpu = time.process_time() - client_before
    cpu = {n: process_tree_cpu(p) - before[n] for n, p in pids.items()}
    gpu_cpu = process_tree_cpu(gpu_pid) - gpu_before
    after_gpu = gpu_counters(urls)
    prompt = after_gpu.get(PROMPT, 0) - before_gpu.get(PROMPT, 0)
    hit = after_gpu.get(HIT, 0) - before_gpu.get(HIT, 0)
    generated = after_gpu.get(GENERATED, 0) - before_gpu.get(GENERATED, 0)
    return Window(
        front,
        workload,
        rnd,
        outcomes,
        wall,
        cpu,
        gpu_cpu,
        hit / prompt if prompt else None,
        {"gpu_generated_tokens": generated, "client_cpu_s": client_cpu},
    )


def warm(stage: Stage, fronts: list[str], plan: Plan) -> None:
    """A few requests through each front first (connections, first health probes)."""
    turns = schedule(
        Shape(rate_rps=8.0, seconds=10.0, max_requests=plan.warmup_requests), plan.seed - 1
    )
    for front in fronts:
        outcomes = asyncio.run(offer(stage.available[front], turns, f"warm{front}", 30, plan.api))
        bad = [o.error for o in outcomes if not o.ok]
        print(f"warm-up {front}: {len(outcomes) - len(bad)} ok, errors {bad[:3]}", flush=True)


def idle_cores(stage: Stage, fronts: list[str], seconds: float) -> dict[str, float]:
    """Cores each front's processes use with no traffic at all (health probes, metric
    scrapes, capacity summaries), measured together over ``seconds``."""
    pids = {f: stage.pids(f) for f in fronts}
    before = {f: sum(process_tree_cpu(p) for p in ps.values()) for f, ps in pids.items()}
    started = time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - started
    return {
        f: (sum(process_tree_cpu(p) for p in ps.values()) - before[f]) / wall
        for f, ps in pids.items()
    }


def net_of_idle(row: dict[str, Any], idle: dict[str, float]) -> None:
    """Adds the window's CPU per request less what the front burns idle over as long."""
    cpu = sum(row["cpu_s"].values()) - idle.get(row["front"], 0.0) * row["wall_s"]
    row["net_cpu_ms_per_request"] = 1e3 * cpu / row["offered"] if row["offered"] else None


def run_rounds(stage: Stage, plan: Plan, idle: dict[str, float]) -> list[dict[str, Any]]:
    """Every window's summary row, in the order run."""
    fronts = [f for f in stage.fronts if f in stage.available]
    warm(stage, fronts, plan)
    rows: list[dict[str, Any]] = []
    for rnd in range(plan.rounds):
        for workload, share in plan.workloads.items():
            shape = Shape(**{**plan.shape.__dict__, "stream_share": share})
            turns = schedule(shape, plan.seed + rnd)
            for i, front in enumerate(rotated(fronts, rnd)):
                salt = f"r{rnd}{workload[0]}{i}x"
                row = summary(window(stage, front, workload, rnd, turns, salt, plan))
                net_of_idle(row, idle)
                rows.append(row)
                print(line(row), flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    """One window as a progress line."""

    def f(key: str, digits: int = 0) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    return (
        f"round {row['round']} {row['workload']:7s} {row['front']:15s} "
        f"ok {row['ok']}/{row['offered']} err {row['errors'] or '-'} "
        f"cpu {f('cpu_ms_per_request', 2)} ms/req {f('cpu_us_per_token')} µs/tok "
        f"ttft p50/p99 {f('ttft_p50_ms')}/{f('ttft_p99_ms')} ms "
        f"e2e p50/p99 {f('e2e_p50_ms')}/{f('e2e_p99_ms')} ms "
        f"tpot p50 {f('tpot_p50_ms', 1)} ms hit {f('prefix_hit', 2)} "
        f"gpu {f('gpu_cpu_ms_per_request', 2)} ms/req{by_process(row)}"
    )


def by_process(row: dict[str, Any]) -> str:
    """A several-process front's CPU split, ms per request offered."""
    if len(row["cpu_s"]) < 2 or not row["offered"]:
        return ""
    split = " ".join(f"{n}={1e3 * c / row['offered']:.1f}" for n, c in row["cpu_s"].items())
    return f" [{split}]"
