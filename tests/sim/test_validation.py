"""The simulator against the real thing: emulated GPUs behind a real local tier (issue 11, item 2).

The quick variant of ``bench.sim_validation``: one zone of mixed GPUs (H100,
2× A100, V100), the same 250 open-loop Poisson arrivals of shared-prefix prompts
sent to real ``sim.worker`` GPU servers behind a real local tier on loopback
and routed through the simulator's deployment of the same topology. The
simulated end-to-end P50 must be within 10 % and P99 within 20 % of the real
one. Time scale 2 (emulated time half as fast as the cost model's seconds)
keeps the router's few milliseconds per request small beside a request's GPU
time, and the run short (about 10 s per level).

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
    LevelResult,
    Quantiles,
    compare,
    level_rate,
)
from bench.sim_validation_real import run_real
from bench.sim_validation_sim import run_sim
from bench.sim_validation_workload import (
    ShapeSpec,
    draw_shapes,
    make_shots,
    mean_shape,
    zone_capacity_rps,
    zone_topology,
)
from common.basics.redis_embed import EmbeddedRedis
from common.request.prefix import BLOCK_TOKENS, prompt_block_hashes
from sim.requests import SIM_MODEL

REQUESTS = 250
TIME_SCALE = 2.0
NOWHERE = "redis://127.0.0.1:1/0"  # the simulator never dials Redis


def _check(level: LevelResult) -> None:
    """Every request served on both sides, P50 and P99 within their tolerances."""
    q50, q90, q99 = level.ratios
    where = (
        f"at {level.load:.0%}: real P50/P90/P99 {level.real.p50_ms:.0f}/{level.real.p90_ms:.0f}"
        f"/{level.real.p99_ms:.0f} ms, sim {level.sim.p50_ms:.0f}/{level.sim.p90_ms:.0f}"
        f"/{level.sim.p99_ms:.0f} ms (ratios {q50:.3f}/{q90:.3f}/{q99:.3f}), "
        f"per GPU real {dict(level.real_per_gpu)} sim {dict(level.sim_per_gpu)}"
    )
    assert level.real_codes == {"OK": REQUESTS}, where
    assert not level.sim_failed and level.sim.n == REQUESTS, where
    assert abs(q50 - 1) <= P50_TOLERANCE, where
    assert abs(q99 - 1) <= P99_TOLERANCE, where


def test_simulated_latency_matches_emulated_gpus_behind_a_real_local_tier(
    redis_server: EmbeddedRedis,
) -> None:
    shapes = draw_shapes(REQUESTS, ShapeSpec(), random.Random(7))
    for load in (0.6, 0.85):
        topology = zone_topology(redis_server.url, time_scale=TIME_SCALE)
        rate = level_rate(topology, shapes, load)
        shots = make_shots(shapes, rate, random.Random(7))
        real = asyncio.run(run_real(topology, shots, timeout_s=60.0, budget_s=60.0))
        level = compare(load, rate, run_sim(topology, shots), real)
        _check(level)
        # Both sides' prefix caches served the same share of the prompts.
        assert level.sim_prefix_hit == pytest.approx(level.real_prefix_hit, abs=0.01)
        if load == 0.85:
            # The comparison catches a GPU model that is 30 % slow.
            slow = replace(topology, time_scale=1.3 * TIME_SCALE)
            wrong = compare(load, rate, run_sim(slow, shots), real)
            assert wrong.ratios[0] > 1 + P50_TOLERANCE
            assert not wrong.passed


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
