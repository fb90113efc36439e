"""The simulator against the real thing: emulated GPUs behind a real local tier (issue 11, item 2).

The quick variant of ``bench.sim_validation``: one zone of mixed GPUs (H100,
2× A100, V100), the same 400 open-loop Poisson arrivals of shared-prefix prompts
at 60 % and 85 % of the zone's capacity, sent to real ``sim.worker`` GPU servers
behind a real local tier on loopback, and routed through the simulator's
deployment of the same topology. The simulated end-to-end P50 must be within
10 % and P99 within 20 % of the real one (P99 of 400 is the 4th largest: noisy,
but the simulator's own spread across timing perturbations stays near ±13 %
here, inside the 20 %). Time scale 2 (emulated time half as fast as the cost
model's seconds) keeps the router's few milliseconds per request small beside a
request's GPU time; the run takes about 30 s.

The local tier's choices are chaotic (a millisecond moves a request to another
GPU and all that follows differs), so the simulated figure is the median of
five runs whose arrivals move by up to 2 ms, the order of the real client's own
send lag; one run of either side strays from that median by ±5-10 % at P50 with
400 requests. Measured over 40 such draws against their median, none strayed
past the tolerances (worst 7.5 % at P50, 12.7 % at P99).

The GPU model is also checked alone: every request replayed on the ``SimGpu``
the real local tier chose for it must come out within 6 % at P50 and 10 % at
P99 of the same requests' real latencies (measured: 0-3 %; requests a per-try
timeout retried are left out, their wasted first attempt being the timeout's).

A real run that disagrees is repeated on fresh ports (at most three runs), and
only a disagreement every run shows fails the test: the machine is shared, and
one real run slowed by other work is the machine, not the simulator.

The other tests check the instrument itself: the workload gives the simulator
what the engine sees, and a GPU model 30 % off is caught.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from bench.sim_validation_compare import (
    P50_TOLERANCE,
    P99_TOLERANCE,
    SIM_JITTER_S,
    LevelResult,
    Quantiles,
    compare,
    level_rate,
)
from bench.sim_validation_real import RealResult, run_real
from bench.sim_validation_sim import replay, run_sim, run_sims
from bench.sim_validation_workload import (
    ShapeSpec,
    Shot,
    draw_shapes,
    make_shots,
    mean_shape,
    zone_capacity_rps,
    zone_topology,
)
from common.basics.redis_embed import EmbeddedRedis
from common.config.topology import Topology
from common.request.prefix import BLOCK_TOKENS, prompt_block_hashes
from sim.requests import SIM_MODEL

REQUESTS = 400
TIME_SCALE = 2.0
SIM_RUNS = 5
SEED = 7
TRIES = 3
# A quiet 2-core machine runs the real side's event loop 2-6 ms late at P99; at 20-30 ms
# (other processes hogging both cores) its requests come out 10-15 % slow.
LATE_LOOP_MS = 10.0
# Measured 0.97-1.00 at P50 and 0.99-1.01 at P99 (retried requests left out).
REPLAY_P50_TOLERANCE = 0.06
REPLAY_P99_TOLERANCE = 0.10
NOWHERE = "redis://127.0.0.1:1/0"  # the simulator never dials Redis


def _disagreement(level: LevelResult) -> str | None:
    """Why this level's real run and the simulator disagree (None: they agree): every
    request served on both sides, P50 and P99 within their tolerances, the GPU model on
    the real placements closer still, and the same share of prompts from the caches."""
    q50, q90, q99 = level.ratios
    r50, _, r99 = level.replay_ratios
    where = (
        f"at {level.load:.0%}: real P50/P90/P99 {level.real.p50_ms:.0f}/{level.real.p90_ms:.0f}"
        f"/{level.real.p99_ms:.0f} ms, sim {level.sim.p50_ms:.0f}/{level.sim.p90_ms:.0f}"
        f"/{level.sim.p99_ms:.0f} ms (ratios {q50:.3f}/{q90:.3f}/{q99:.3f}; one simulated "
        f"run strays ±{level.sim_spread[0]:.1%}/±{level.sim_spread[2]:.1%} at P50/P99), "
        f"per GPU real {dict(level.real_per_gpu)} sim {dict(level.sim_per_gpu)}, retried "
        f"{level.real_retried}/{level.sim_retried}, real loop lag P99 "
        f"{level.loop_lag_p99_ms:.1f} ms, router at idle {level.idle_overhead_ms:.1f} ms; "
        f"GPU model on the real placements: {r50:.3f} / {r99:.3f}; prefix hits real "
        f"{level.real_prefix_hit:.3f} sim {level.sim_prefix_hit:.3f}"
    )
    agree = (
        level.real_codes == {"OK": REQUESTS}
        and not level.sim_failed
        and level.sim.n == REQUESTS
        and abs(q50 - 1) <= P50_TOLERANCE
        and abs(q99 - 1) <= P99_TOLERANCE
        # The GPU model alone, on the real tier's placements, is closer still: what is
        # left is the router's few ms per request (requests a per-try timeout retried
        # are left out: their wasted first attempt is the timeout's, not the model's).
        and abs(r50 - 1) <= REPLAY_P50_TOLERANCE
        and abs(r99 - 1) <= REPLAY_P99_TOLERANCE
        and abs(level.sim_prefix_hit - level.real_prefix_hit) <= 0.01
    )
    return None if agree else where


def _real_run(redis_url: str, shots: list[Shot]) -> RealResult | None:
    """One real run on fresh ports; None when it ran late: a busy machine delays the
    emulated GPUs' steps and the router alike, and the comparison would then measure
    the machine."""
    topology = zone_topology(redis_url, time_scale=TIME_SCALE)  # fresh ports
    real = asyncio.run(run_real(topology, shots, timeout_s=60.0, budget_s=60.0))
    return real if real.loop_lag_p99_ms <= LATE_LOOP_MS else None


def _agreeing_level(
    redis_url: str, topology: Topology, shots: list[Shot], load: float, rate: float
) -> tuple[RealResult, dict[int, float]]:
    """The level compared against up to ``TRIES`` real runs: the first that agrees with
    the simulator is returned, with the GPU model's replay of its placements. A
    disagreement must repeat to fail the test: the CI machine is shared, and a real run
    on it can be slowed by work the loop-lag probe does not see (there, once, its P50
    came out 11 % slower than the GPU model replaying its own placements, with the loop
    only 7 ms late). A simulator that is really off (the GPU model 30 % slow below)
    disagrees with every run. Skips when no run was on time."""
    sims = run_sims(topology, shots, runs=SIM_RUNS, jitter_s=SIM_JITTER_S, seed=SEED)
    disagreements, late = [], 0
    for _ in range(TRIES):
        real = _real_run(redis_url, shots)
        if real is None:
            late += 1
            continue
        replayed = replay(topology, shots, real.gpu_of)
        why = _disagreement(compare(load, rate, sims, real, replayed))
        if why is None:
            return real, replayed
        disagreements.append(why)
    if not disagreements:
        pytest.skip(
            f"the machine is too busy for a timing comparison: the real side's event loop "
            f"ran > {LATE_LOOP_MS:g} ms late at P99 in {TRIES} tries"
        )
    pytest.fail(
        f"the simulator disagreed with {len(disagreements)} real run(s) ({late} more ran "
        "late): " + " | ".join(disagreements)
    )


def test_simulated_latency_matches_emulated_gpus_behind_a_real_local_tier(
    redis_server: EmbeddedRedis,
) -> None:
    shapes = draw_shapes(REQUESTS, ShapeSpec(), random.Random(SEED))
    topology = zone_topology(NOWHERE, time_scale=TIME_SCALE)  # what the simulator is given
    for load in (0.6, 0.85):
        rate = level_rate(topology, shapes, load)
        shots = make_shots(shapes, rate, random.Random(SEED))
        real, replayed = _agreeing_level(redis_server.url, topology, shots, load, rate)
        if load == 0.85:
            # The comparison catches a GPU model that is 30 % slow.
            slow = replace(topology, time_scale=1.3 * TIME_SCALE)
            wrong = compare(load, rate, [run_sim(slow, shots)], real, replayed)
            assert wrong.ratios[0] > 1 + P50_TOLERANCE
            assert not wrong.passed
            assert _disagreement(wrong) is not None


def test_the_simulator_is_given_what_the_engine_counts_and_hashes() -> None:
    shapes = draw_shapes(60, ShapeSpec(), random.Random(3))
    shots = make_shots(shapes, 10.0, random.Random(3))
    for shot in shots:
        req = shot.sim_request(1.0)
        assert req.prompt_tokens == len(shot.prompt.split())
        assert list(req.prefix_blocks) == prompt_block_hashes(shot.prompt, model=SIM_MODEL)
        assert req.output_tokens == shot.max_tokens and req.at_s == 1.0 + shot.at_s
    # Requests with the same system prompt share its whole blocks, and no more.
    spec = ShapeSpec()
    by_system: dict[str, list[tuple[int, ...]]] = {}
    for shape, shot in zip(shapes, shots, strict=True):
        system = " ".join(shape.prompt.split()[: shape.shared_words])
        by_system.setdefault(system, []).append(shot.blocks)
    assert len(by_system) == len(spec.system_prompt_words)
    for system, blocks in by_system.items():
        shared = len(system.split()) // BLOCK_TOKENS
        assert all(b[:shared] == blocks[0][:shared] for b in blocks)
        assert len({b[shared] for b in blocks if len(b) > shared}) > 1
    # Poisson arrivals at the asked rate: mean gap 1 / rate within sampling error.
    assert shots[0].at_s == 0.0
    assert 0.07 < shots[-1].at_s / (len(shots) - 1) < 0.13


def test_capacity_counts_a_warm_prefix_cache_and_the_time_scale() -> None:
    shapes = draw_shapes(200, ShapeSpec(), random.Random(5))
    mean = mean_shape(shapes)
    assert 0 < mean.uncached_prompt < mean.prompt
    fast = zone_topology(NOWHERE, time_scale=1.0)
    slow = zone_topology(NOWHERE, time_scale=4.0)
    warm = zone_capacity_rps(fast, shapes)
    assert zone_capacity_rps(slow, shapes) == pytest.approx(warm / 4)
    assert zone_capacity_rps(fast, shapes, warm=False) < warm


def test_the_simulated_side_is_deterministic() -> None:
    shapes = draw_shapes(150, ShapeSpec(), random.Random(2))
    topology = zone_topology(NOWHERE, time_scale=TIME_SCALE)
    shots = make_shots(shapes, level_rate(topology, shapes, 0.85), random.Random(2))
    a, b = run_sim(topology, shots), run_sim(topology, shots)
    assert a.latencies_s == b.latencies_s and len(a.latencies_s) == len(shots)


def test_bad_inputs_say_what_to_fix() -> None:
    shapes = draw_shapes(20, ShapeSpec(), random.Random(1))
    topology = zone_topology(NOWHERE, time_scale=TIME_SCALE)
    with pytest.raises(ValueError, match=r"a load level must be > 0 \(a fraction of capacity\)"):
        level_rate(topology, shapes, 0.0)
    with pytest.raises(ValueError, match="the arrival rate must be > 0 requests/s, got -1"):
        make_shots(shapes, -1.0, random.Random(1))
    with pytest.raises(ValueError, match="no request was served: there is no latency to compare"):
        Quantiles.of([])
