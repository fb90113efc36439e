"""bench.field_routers: the pure pieces (none needs the routers' virtualenv), and a short
run of the whole-chain front alone."""

from __future__ import annotations

import itertools
import math

import pytest

from bench.field_routers.__main__ import main
from bench.field_routers.client import body
from bench.field_routers.run import net_of_idle, rotated
from bench.field_routers.stats import (
    INF,
    Outcome,
    Window,
    cpu_per,
    median_of,
    percentile,
    ratios,
    summary,
)
from bench.field_routers.workload import Shape, capacity_rps, salted, schedule

SHAPE = Shape(rate_rps=12.0, seconds=30.0)


def ok(e2e: float, ttft: float = 0.1, tokens: int = 10) -> Outcome:
    return Outcome(True, tokens, ok=True, ttft_s=ttft, e2e_s=e2e, tokens=tokens)


def failed(kind: str = "timeout") -> Outcome:
    return Outcome(True, 10, ok=False, error=kind, e2e_s=60.0)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([], 50) is None


def test_failures_count_as_infinitely_late_in_every_percentile() -> None:
    outcomes = [ok(1.0)] * 98 + [failed(), failed("http_503")]
    row = summary(Window("f", "stream", 0, outcomes, 10.0, {"p": 1.0}, 0.5))
    assert row["e2e_p50_ms"] == pytest.approx(1000.0)
    assert row["e2e_p99_ms"] == INF  # 2 % failed: the P99 lands on a failure
    assert row["ttft_p99_ms"] == INF
    assert row["errors"] == {"timeout": 1, "http_503": 1}
    assert row["offered"] == 100 and row["ok"] == 98


def test_a_failed_request_does_not_lower_the_percentile() -> None:
    """Dropping the slowest requests must not make a front look faster."""
    served = [ok(float(i)) for i in range(1, 101)]
    dropped = [ok(float(i)) for i in range(1, 91)] + [failed() for _ in range(10)]
    fast = summary(Window("a", "w", 0, served, 1.0, {}, 0.0))
    lossy = summary(Window("b", "w", 0, dropped, 1.0, {}, 0.0))
    assert lossy["e2e_p99_ms"] > fast["e2e_p99_ms"]


def test_cpu_per_request_and_per_token() -> None:
    per_request, per_token = cpu_per(0.5, requests=100, tokens=8000)
    assert per_request == pytest.approx(5.0)  # ms
    assert per_token == pytest.approx(62.5)  # µs
    assert cpu_per(0.5, 0, 0) == (None, None)


def test_window_cpu_is_every_process_of_the_front_per_request_offered() -> None:
    outcomes = [ok(1.0, tokens=50)] * 9 + [failed()]
    cpu = {"global": 0.2, "regional": 0.1, "local": 0.1, "redis": 0.1}
    row = summary(Window("meridian", "stream", 0, outcomes, 5.0, cpu, 0.3))
    assert row["cpu_ms_per_request"] == pytest.approx(50.0)  # 0.5 s over 10 offered
    assert row["cpu_us_per_token"] == pytest.approx(0.5e6 / 450)  # over tokens delivered
    assert row["gpu_cpu_ms_per_request"] == pytest.approx(30.0)


def test_net_of_idle_takes_out_what_the_front_burns_with_no_traffic() -> None:
    row = {"front": "m", "cpu_s": {"a": 0.3, "b": 0.2}, "wall_s": 10.0, "offered": 50}
    net_of_idle(row, {"m": 0.02})  # 2 % of a core: 0.2 s over the 10 s window
    assert row["net_cpu_ms_per_request"] == pytest.approx(6.0)


def test_time_per_output_token_is_after_the_first() -> None:
    row = summary(Window("f", "w", 0, [ok(1.1, ttft=0.1, tokens=11)], 1.0, {}, 0.0))
    assert row["tpot_p50_ms"] == pytest.approx(100.0)


def test_medians_over_rounds_keep_infinity_last() -> None:
    assert median_of([1.0, INF, 3.0]) == 3.0
    assert median_of([1.0, INF]) == INF
    assert median_of([None, 2.0]) == 2.0
    assert median_of([]) is None


def test_ratios_are_to_the_best_peer_of_the_same_round() -> None:
    rows = [
        {"round": 0, "front": "m", "cpu": 8.0},
        {"round": 0, "front": "p1", "cpu": 2.0},
        {"round": 0, "front": "p2", "cpu": 4.0},
        {"round": 1, "front": "m", "cpu": 9.0},
        {"round": 1, "front": "p1", "cpu": 6.0},
        {"round": 1, "front": "p2", "cpu": 3.0},
    ]
    got = ratios(rows, ("p1", "p2"), "cpu")
    assert got["m"] == pytest.approx((4.0 + 3.0) / 2)
    assert got["p1"] == pytest.approx((1.0 + 2.0) / 2)


def test_the_schedule_is_the_same_for_every_front_and_differs_by_seed() -> None:
    first, again = schedule(SHAPE, 7), schedule(SHAPE, 7)
    assert first == again
    assert schedule(SHAPE, 8) != first
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(first))
    assert 0.7 * 12 * 30 < len(first) < 1.3 * 12 * 30


def test_the_schedule_has_shared_prefixes_and_multi_turn_conversations() -> None:
    turns = schedule(SHAPE, 7)
    later = [t for t in turns if t.index > 0]
    assert len(later) > len(turns) / 2
    for turn in later[:20]:  # each turn resends the conversation so far
        assert len(turn.messages) == 2 * turn.index + 2
        assert turn.messages[0][0] == "system"
    assert len({t.prefix for t in turns}) == SHAPE.prefixes
    assert len({t.conversation for t in turns}) < len(turns)


def test_a_salt_changes_the_prefix_but_not_the_token_count() -> None:
    turn = schedule(SHAPE, 7)[0]
    a, b = salted(turn, "r0s0x"), salted(turn, "r0s1x")
    assert a[0]["content"] != b[0]["content"]
    assert [len(m["content"].split()) for m in a] == [len(c.split()) for _, c in turn.messages]


def test_completions_render_the_chat_as_the_gpu_does() -> None:
    turn = schedule(SHAPE, 7)[0]
    doc = body(turn, "s", "completions")
    assert doc["max_tokens"] == turn.max_tokens
    assert str(doc["prompt"]).splitlines()[0].startswith("system: s ")
    assert "messages" in body(turn, "s", "chat")


def test_rotation_gives_every_front_every_position() -> None:
    fronts = ["a", "b", "c"]
    firsts = {rotated(fronts, r)[0] for r in range(3)}
    assert firsts == set(fronts)
    assert rotated([], 2) == []


def test_capacity_follows_the_engine_cost_model() -> None:
    one = capacity_rps(1, 1.0, 16, 1.0, out_tokens=80, new_tokens=0)
    # 80 tokens at (4 ms / 16 + 0.2 ms) each: 36 ms of one A100's time per request.
    assert one == pytest.approx(1 / 0.036)
    assert capacity_rps(8, 2.0, 16, 20.0, 80, 0) == pytest.approx(16 * one / 20)
    assert capacity_rps(1, 1.0, 16, 1.0, 80, 100) < one


def test_a_short_run_of_the_whole_chain() -> None:
    """A few seconds of front (a) alone: every request answered, its CPU counted."""
    argv = "--fronts meridian --workloads stream --gpus 2 --time-scale 2 --seconds 2"
    result = main([*argv.split(), "--rounds", "1", "--load", "0.2", "--idle", "1", "--no-write"])
    (row,) = result["windows"]
    assert row["front"] == "meridian" and row["offered"] > 0
    assert row["ok"] == row["offered"], row["errors"]
    assert set(row["cpu_s"]) == {"global", "regional-us-east", "local-us-east-1a", "redis"}
    assert 0 < row["cpu_ms_per_request"] < math.inf
    assert row["tpot_p50_ms"] is not None
    assert row["net_cpu_ms_per_request"] < row["cpu_ms_per_request"]
