"""One load level of the validation bench: the same shots on both sides, and their comparison.

``run_level`` draws the level's arrivals (the shapes are the bench's, the rate is
``load`` × the zone's capacity from ``sim.capacity``), routes them through the
simulator first and then through a fresh real zone (``asyncio.run``: the
simulator runs on its own simulated loop, which cannot run inside another), and
compares the two end-to-end latency distributions: P50 must agree within
``P50_TOLERANCE`` and P99 within ``P99_TOLERANCE`` (sim / real). P90 is
reported beside them, and the figures that explain a gap: where the requests
went (per GPU), how much of the prompts the prefix caches served, each GPU's
mean running batch, and what the real router added at idle.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.report import pct
from bench.sim_validation_real import RealResult, run_real
from bench.sim_validation_sim import SimResult, replay, run_sims
from bench.sim_validation_workload import Shape, make_shots, zone_capacity_rps
from common.config.topology import Topology

P50_TOLERANCE = 0.10
P90_TOLERANCE = 0.20
P99_TOLERANCE = 0.20
# Simulated runs per level beyond the first move each arrival later by up to this: the
# order of the real client's own send lag (sim_validation_real's send_lag_s).
SIM_JITTER_S = 0.002


@dataclass(frozen=True)
class Quantiles:
    """End-to-end latency percentiles in ms (nearest rank)."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    n: int

    @classmethod
    def of(cls, latencies_s: Sequence[float]) -> Quantiles:
        if not latencies_s:
            raise ValueError("no request was served: there is no latency to compare")
        ms = [1000 * v for v in latencies_s]
        return cls(_pct(ms, 0.50), _pct(ms, 0.90), _pct(ms, 0.99), len(ms))

    @property
    def values(self) -> tuple[float, float, float]:
        return self.p50_ms, self.p90_ms, self.p99_ms

    @classmethod
    def median_of(cls, runs: Sequence[Quantiles]) -> Quantiles:
        """Each percentile's median over several runs (the smallest n)."""
        p50, p90, p99 = (statistics.median(q.values[i] for q in runs) for i in range(3))
        return cls(p50, p90, p99, min(q.n for q in runs))


def spread(runs: Sequence[Quantiles], centre: Quantiles) -> tuple[float, float, float]:
    """Per percentile, the largest relative distance of one run from ``centre``."""
    p50, p90, p99 = (max(abs(q.values[i] / centre.values[i] - 1.0) for q in runs) for i in range(3))
    return p50, p90, p99


def _pct(values: Sequence[float], q: float) -> float:
    found = pct(values, q)
    assert found is not None
    return found


def within(ratio: float, tolerance: float) -> bool:
    return abs(ratio - 1.0) <= tolerance


@dataclass(frozen=True)
class LevelResult:
    load: float  # of the zone's capacity
    rate_rps: float  # real requests per second
    requests: int
    real: Quantiles
    sim: Quantiles  # the median over the simulated runs
    sim_runs: int
    sim_spread: tuple[float, float, float]  # how far one simulated run strays from it
    # The GPU model alone: every request on the SimGpu the real tier chose, against the
    # real latencies of the same requests (those served in one attempt).
    replay: Quantiles
    real_single: Quantiles
    real_codes: Mapping[str, int]
    sim_failed: Mapping[str, int]
    real_retried: int
    sim_retried: int
    real_per_gpu: Mapping[str, int]
    sim_per_gpu: Mapping[str, int]
    real_prefix_hit: float
    sim_prefix_hit: float
    real_batch: Mapping[str, float]
    sim_batch: Mapping[str, float]
    idle_overhead_ms: float
    loop_lag_p99_ms: float
    process_cpu_cores: float
    real_seconds: float

    @property
    def ratios(self) -> tuple[float, float, float]:
        """sim / real at P50, P90, P99."""
        r, s = self.real, self.sim
        return s.p50_ms / r.p50_ms, s.p90_ms / r.p90_ms, s.p99_ms / r.p99_ms

    @property
    def replay_ratios(self) -> tuple[float, float, float]:
        """GPU model on the real placements / real, at P50, P90, P99."""
        r, s = self.real_single, self.replay
        return s.p50_ms / r.p50_ms, s.p90_ms / r.p90_ms, s.p99_ms / r.p99_ms

    @property
    def p50_ok(self) -> bool:
        return within(self.ratios[0], P50_TOLERANCE)

    @property
    def p90_ok(self) -> bool:
        return within(self.ratios[1], P90_TOLERANCE)

    @property
    def p99_ok(self) -> bool:
        return within(self.ratios[2], P99_TOLERANCE)

    @property
    def all_served(self) -> bool:
        return set(self.real_codes) == {"OK"} and not self.sim_failed

    @property
    def passed(self) -> bool:
        return self.all_served and self.p50_ok and self.p99_ok


def level_rate(topology: Topology, shapes: Sequence[Shape], load: float) -> float:
    if not 0 < load:
        raise ValueError(f"a load level must be > 0 (a fraction of capacity), got {load}")
    return load * zone_capacity_rps(topology, shapes)


def run_level(
    topology: Topology,
    shapes: Sequence[Shape],
    load: float,
    *,
    seed: int,
    sim_runs: int,
    timeout_s: float,
    budget_s: float,
) -> LevelResult:
    """Both sides at ``load`` on ``topology`` (whose listeners must be free)."""
    rate = level_rate(topology, shapes, load)
    shots = make_shots(shapes, rate, random.Random(seed))
    sims = run_sims(topology, shots, runs=sim_runs, jitter_s=SIM_JITTER_S, seed=seed)
    real = asyncio.run(run_real(topology, shots, timeout_s=timeout_s, budget_s=budget_s))
    return compare(load, rate, sims, real, replay(topology, shots, real.gpu_of))


def compare(
    load: float,
    rate: float,
    sims: Sequence[SimResult],
    real: RealResult,
    replayed: Mapping[int, float],
) -> LevelResult:
    """The real run against the simulated runs (the first of them on the exact arrivals,
    whose placements and cache figures the details show) and against the GPU model
    replaying the real placements (over the requests served in one attempt: a retried
    one's wasted first attempt is the per-try timeout's, not the GPU model's)."""
    real_ok = real.ok_latencies
    assert real.idle_overhead_ms is not None, "the validation's real side is the local tier"
    runs = [Quantiles.of(list(s.latencies_s.values())) for s in sims]
    centre = Quantiles.median_of(runs)
    sim = sims[0]
    return LevelResult(
        load=load,
        rate_rps=rate,
        requests=len(real.samples),
        real=Quantiles.of(list(real_ok.values())),
        sim=centre,
        sim_runs=len(sims),
        sim_spread=spread(runs, centre),
        replay=Quantiles.of([v for i, v in replayed.items() if i not in real.retried_ids]),
        real_single=Quantiles.of(
            [v for i, v in real_ok.items() if i not in real.retried_ids and i in replayed]
        ),
        real_codes=real.codes,
        sim_failed=dict(sum((Counter(s.failed) for s in sims), Counter())),
        real_retried=real.retried,
        sim_retried=sim.retried,
        real_per_gpu=real.requests_per_gpu,
        sim_per_gpu=sim.requests_per_gpu,
        real_prefix_hit=real.prefix_hit_share,
        sim_prefix_hit=sim.prefix_hit_share,
        real_batch=real.mean_batch,
        sim_batch=sim.mean_batch,
        idle_overhead_ms=real.idle_overhead_ms,
        loop_lag_p99_ms=real.loop_lag_p99_ms,
        process_cpu_cores=real.process_cpu_cores,
        real_seconds=real.seconds,
    )


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


TABLE_HEADER = (
    "| load | req/s | n | P50 real / sim ms | ratio | P90 real / sim ms | ratio "
    "| P99 real / sim ms | ratio | sim runs' spread P50/P90/P99 | P50 ±10% | P99 ±20% "
    "| GPU model on the real placements P50/P90/P99 |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|:---:|---:|"
)


def table_row(level: LevelResult) -> str:
    r, s = level.real, level.sim
    q50, q90, q99 = level.ratios
    return (
        f"| {level.load:.0%} | {level.rate_rps:.2f} | {level.requests} "
        f"| {r.p50_ms:.0f} / {s.p50_ms:.0f} | {q50:.3f} "
        f"| {r.p90_ms:.0f} / {s.p90_ms:.0f} | {q90:.3f} "
        f"| {r.p99_ms:.0f} / {s.p99_ms:.0f} | {q99:.3f} "
        f"| ±{level.sim_spread[0]:.1%} / ±{level.sim_spread[1]:.1%} / ±{level.sim_spread[2]:.1%} "
        f"({level.sim_runs}) | {verdict(level.p50_ok)} | {verdict(level.p99_ok)} "
        f"| {' / '.join(f'{x:.3f}' for x in level.replay_ratios)} |"
    )


def detail_row(level: LevelResult) -> str:
    gpus = sorted(level.real_per_gpu)
    placed = ", ".join(
        f"{g} {level.real_per_gpu.get(g, 0)}/{level.sim_per_gpu.get(g, 0)}" for g in gpus
    )
    batch = ", ".join(
        f"{level.real_batch.get(g, 0.0):.1f}/{level.sim_batch.get(g, 0.0):.1f}" for g in gpus
    )
    codes = ", ".join(f"{c} {n}" for c, n in sorted(level.real_codes.items()))
    failed = ", ".join(f"{c} {n}" for c, n in sorted(level.sim_failed.items())) or "none"
    return (
        f"| {level.load:.0%} | {placed} | {level.real_prefix_hit:.1%} / "
        f"{level.sim_prefix_hit:.1%} | {batch} | {level.real_retried} / {level.sim_retried} "
        f"| {codes} / failed {failed} "
        f"| {level.idle_overhead_ms:.1f} | {level.loop_lag_p99_ms:.1f} "
        f"| {level.process_cpu_cores:.2f} | {level.real_seconds:.0f} |"
    )


DETAIL_HEADER = (
    "| load | requests per GPU real/sim | prefix hit real / sim | mean batch real/sim "
    "| retried real / sim | real codes / sim failures | router at idle ms | loop lag P99 ms "
    "| CPU cores | real s |\n"
    "|---:|---|---:|---|---:|---|---:|---:|---:|---:|"
)
