"""``bench.zone_peers --simulate``: the same zone and workload in the fleet simulator.

Seconds instead of minutes, so several seeds and loads: each seed draws its own
requests and arrivals, and every front's policy set routes the same ones
(``bench.sim_validation_sim.run_sim``: the real local balancer and picker over the
GPU model that ``bench.sim_validation`` checks against the real GPUs). *meridian*
and *completion_time* are the servers' local policies; *nginx* is the simulator's
``nginx_least_conn`` set (weighted least connections; inside one zone HAProxy's
``leastconn`` with the same weights is the same rule, so it has no row of its own).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from bench.report import pct
from bench.sim_validation_sim import run_sim
from bench.sim_validation_workload import (
    Shape,
    ShapeSpec,
    draw_shapes,
    make_shots,
    zone_capacity_rps,
)
from common.config.topology import Topology
from sim.policies import MERIDIAN, PolicySet, policy_set


def sim_policies() -> dict[str, PolicySet]:
    meridian = policy_set(MERIDIAN)
    return {
        "meridian": meridian,
        "completion_time": replace(
            meridian, name="completion_time", local_policy="completion_time"
        ),
        "nginx": policy_set("nginx_least_conn"),
    }


@dataclass
class SimRow:
    """One front at one load: medians over the seeds, and its ratios to meridian's."""

    front: str
    load: float
    seeds: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    p50_ratio: float  # median over seeds of this front's P50 over meridian's (same seed)
    p99_ratio: float
    mean_ratio: float


def simulate(
    topology: Topology,
    fronts: Sequence[str],
    loads: Sequence[float],
    requests: int,
    seeds: int,
    *,
    draw: Callable[[int, ShapeSpec, random.Random], list[Shape]] = draw_shapes,
) -> list[SimRow]:
    policies = sim_policies()
    wanted = [f for f in fronts if f in policies]
    if "meridian" not in wanted:
        wanted.insert(0, "meridian")
    rows = []
    for load in loads:
        runs: dict[str, list[tuple[float, float, float]]] = {f: [] for f in wanted}
        for seed in range(1, seeds + 1):
            shapes = draw(requests, ShapeSpec(), random.Random(seed))
            rate = load * zone_capacity_rps(topology, shapes)
            shots = make_shots(shapes, rate, random.Random(seed))
            for front in wanted:
                result = run_sim(topology, shots, seed=seed, policies=policies[front])
                ms = [1000 * v for v in result.latencies_s.values()]
                p50, p99 = pct(ms, 0.5) or 0.0, pct(ms, 0.99) or 0.0
                runs[front].append((p50, p99, statistics.fmean(ms)))
        base = runs["meridian"]
        for front in wanted:
            mine = runs[front]
            ratio = [
                statistics.median(m[i] / b[i] for m, b in zip(mine, base, strict=True))
                for i in range(3)
            ]
            medians = [statistics.median(m[i] for m in mine) for i in range(3)]
            rows.append(SimRow(front, load, seeds, *medians, *ratio))
    return rows


def sim_markdown(rows: Sequence[SimRow], header: str) -> str:
    lines = [
        header,
        "",
        "| load | front | P50 ms | P99 ms | mean ms | P50 ÷ meridian's | P99 ÷ meridian's "
        "| mean ÷ meridian's |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.load:.0%} | {r.front} | {r.p50_ms:.0f} | {r.p99_ms:.0f} | {r.mean_ms:.0f} "
            f"| {r.p50_ratio:.2f} | {r.p99_ratio:.2f} | {r.mean_ratio:.2f} |"
        )
    return "\n".join(lines) + "\n"
