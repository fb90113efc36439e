"""Baseline local pickers and the policy mapping: one named test per behaviour."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from common.basics.vocabulary import Priority
from common.config.node import Endpoint
from common.request.pick import Picker, PickRequest
from common.request.prefix import BLOCK_TOKENS
from local_lb.baselines import (
    EnvoyLeastRequestPicker,
    LeastConnectionsPicker,
    LeastResponseTimePicker,
    PowerOfTwoPicker,
    RoundRobinPicker,
    SglangCacheAwarePicker,
    WeightedLeastConnectionsPicker,
    WeightedRoundRobinPicker,
    nginx_weight,
)
from local_lb.baselines_llm import InferenceGatewayPicker, queue_scores
from local_lb.load_book import LoadSample
from local_lb.policies import POLICIES, make_picker
from local_lb.state import GpuChild, LocalView

MODEL = "m"


def gpu(
    name: str, *, speed: float = 1.0, outstanding: int = 0, latency: float = 0.0, slots: int = 256
) -> GpuChild:
    g = GpuChild(
        name=name,
        endpoint=Endpoint("127.0.0.1", 1),
        models=frozenset({MODEL}),
        speed=speed,
        slots=slots,
    )
    g.outstanding_requests = outstanding
    g.latency_ewma_s = latency
    return g


def view_of(*gpus: GpuChild) -> LocalView:
    return LocalView(gpus=gpus)


def request(prompt_tokens: int = 64, prefix: tuple[int, ...] = ()) -> PickRequest:
    return PickRequest(
        model=MODEL,
        version="",
        origin=None,
        session=None,
        priority=Priority.STANDARD,
        prompt_tokens=prompt_tokens,
        max_tokens=16,
        prefix_blocks=prefix,
    )


def first(picker: Picker, view: LocalView, req: PickRequest | None = None) -> str:
    ranked = picker.rank(req or request(), view.free[MODEL], 0.0)
    return str(ranked[0].name)


def test_round_robin_cycles_over_serving_gpus() -> None:
    view = view_of(gpu("a"), gpu("b"), gpu("c"))
    picker = RoundRobinPicker(view)
    assert [first(picker, view) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_round_robin_skips_gpus_not_in_pool() -> None:
    view = view_of(gpu("a"), gpu("b", slots=1, outstanding=1), gpu("c"))
    picker = RoundRobinPicker(view)
    assert [first(picker, view) for _ in range(4)] == ["a", "c", "a", "c"]


def test_smooth_weighted_round_robin_shares_exact_over_a_period() -> None:
    view = view_of(gpu("h100", speed=2.0), gpu("a", speed=1.0), gpu("b", speed=1.0))
    picker = WeightedRoundRobinPicker(view)
    picks = [first(picker, view) for _ in range(4 * 25)]
    for period in range(25):
        window = Counter(picks[4 * period : 4 * period + 4])
        assert window == {"h100": 2, "a": 1, "b": 1}
    assert picks[:4] == ["h100", "a", "b", "h100"]  # nginx's interleaving, not h100,h100,a,b


def test_least_connections_picks_fewest_outstanding() -> None:
    view = view_of(
        gpu("busy", outstanding=5), gpu("idle", outstanding=1), gpu("mid", outstanding=3)
    )
    ranked = LeastConnectionsPicker(random.Random(1)).rank(request(), view.free[MODEL], 0.0)
    assert [g.name for g in ranked] == ["idle", "mid", "busy"]


def test_least_connections_breaks_ties_randomly() -> None:
    view = view_of(gpu("a", outstanding=1), gpu("b", outstanding=1), gpu("c", outstanding=2))
    picker = LeastConnectionsPicker(random.Random(7))
    assert {first(picker, view) for _ in range(50)} == {"a", "b"}


def test_power_of_two_never_picks_the_more_loaded_of_its_two() -> None:
    view = view_of(*(gpu(f"g{i}", outstanding=i) for i in range(8)))
    picker = PowerOfTwoPicker(random.Random(3))
    for _ in range(500):
        low, high = picker.rank(request(), view.free[MODEL], 0.0)
        assert low.outstanding_requests < high.outstanding_requests
    # The most loaded GPU can only ever be second, so it is never picked.
    assert all(first(picker, view) != "g7" for _ in range(500))


def test_least_response_time_picks_lowest_latency_ewma() -> None:
    view = view_of(gpu("slow", latency=2.0), gpu("fast", latency=0.4), gpu("mid", latency=1.0))
    ranked = LeastResponseTimePicker(random.Random(1)).rank(request(), view.free[MODEL], 0.0)
    assert [g.name for g in ranked] == ["fast", "mid", "slow"]


def test_least_response_time_tries_unknown_latency_first() -> None:
    view = view_of(gpu("fast", latency=0.1), gpu("new", latency=0.0))
    assert first(LeastResponseTimePicker(random.Random(1)), view) == "new"


def test_sglang_imbalance_picks_shortest_queue() -> None:
    # 100 - 10 > 64 and 100 > 1.5 * 10: imbalanced, so the cache is ignored.
    view = view_of(
        gpu("hot", outstanding=100), gpu("cold", outstanding=10), gpu("mid", outstanding=50)
    )
    blocks = (11, 12, 13, 14)
    view.prefix.record(blocks, "mid")
    req = request(prompt_tokens=4 * BLOCK_TOKENS, prefix=blocks)
    assert first(SglangCacheAwarePicker(view, random.Random(1)), view, req) == "cold"


def test_sglang_high_match_picks_cached_gpu_even_if_busier() -> None:
    view = view_of(gpu("warm", outstanding=30), gpu("idle", outstanding=0))
    blocks = (21, 22, 23, 24)
    view.prefix.record(blocks, "warm")
    # 4 of 5 blocks cached: rate 0.8 > 0.3; load 30 vs 0 is within the 64 absolute threshold.
    req = request(prompt_tokens=5 * BLOCK_TOKENS, prefix=(*blocks, 25))
    assert first(SglangCacheAwarePicker(view, random.Random(1)), view, req) == "warm"


def test_sglang_low_match_picks_smallest_tree() -> None:
    view = view_of(gpu("big"), gpu("partial"), gpu("small"))
    view.prefix.record(tuple(range(100, 140)), "big")
    view.prefix.record((31, 50, 51), "partial")
    view.prefix.record((900, 901), "small")
    # Trees: big 40, partial 3, small 2 blocks. 1 of 10 blocks cached on "partial":
    # rate 0.1 <= 0.3, so the smallest tree wins.
    req = request(prompt_tokens=10 * BLOCK_TOKENS, prefix=(31, *range(32, 41)))
    assert first(SglangCacheAwarePicker(view, random.Random(1)), view, req) == "small"


def test_nginx_weight_is_ten_per_a100_and_never_zero() -> None:
    assert [nginx_weight(s) for s in (0.6, 1.0, 2.0, 2.3, 0.01)] == [6, 10, 20, 23, 1]


def test_weighted_least_connections_divides_connections_by_weight() -> None:
    # conns / weight: h100 3/20 = 0.15, v100 1/6 = 0.167, a100 2/10 = 0.2. Plain
    # least connections would take the V100 (1 connection).
    view = view_of(
        gpu("h100", speed=2.0, outstanding=3),
        gpu("a100", speed=1.0, outstanding=2),
        gpu("v100", speed=0.6, outstanding=1),
    )
    ranked = WeightedLeastConnectionsPicker().rank(request(), view.free[MODEL], 0.0)
    assert [g.name for g in ranked] == ["h100", "v100", "a100"]


def test_weighted_least_connections_rotates_ties_by_smooth_weighted_round_robin() -> None:
    # h100 2/20 and a100 1/10 tie at 0.1; v100 3/6 never ties. Among the tied,
    # smooth WRR with weights 20:10: current weights (20,10) -> h100 wins, pays
    # back 30 -> (-10,10) + (20,10) = (10,20) -> a100 -> (30,0) -> h100 -> (20,10)...
    view = view_of(
        gpu("h100", speed=2.0, outstanding=2),
        gpu("a100", speed=1.0, outstanding=1),
        gpu("v100", speed=0.6, outstanding=3),
    )
    picker = WeightedLeastConnectionsPicker()
    picks = [first(picker, view) for _ in range(6)]
    assert picks == ["h100", "a100", "h100", "h100", "a100", "h100"]


def test_weighted_least_connections_single_winner_leaves_rotation_untouched() -> None:
    a, b = gpu("a", outstanding=1), gpu("b", outstanding=1)
    view = view_of(a, b)
    picker = WeightedLeastConnectionsPicker()
    assert first(picker, view) == "a"  # tie: (10,10) -> a, pays back 20 -> (-10,10)
    b.outstanding_requests = 0
    assert first(picker, view) == "b"  # b alone: no current weight changes
    b.outstanding_requests = 1
    assert first(picker, view) == "b"  # tie again: (0, 20) -> b


def test_envoy_least_request_draws_two_with_replacement() -> None:
    # The busy GPU wins only when both draws are it: probability 1/4. Drawing
    # without replacement (the power_of_two policy) would never pick it.
    view = view_of(gpu("idle", outstanding=0), gpu("busy", outstanding=5))
    picker = EnvoyLeastRequestPicker(random.Random(11), view)
    picks = Counter(first(picker, view) for _ in range(8000))
    assert abs(picks["busy"] / 8000 - 0.25) < 0.02


class Draws(random.Random):
    """A Random whose ``random()`` returns the given values in turn."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_envoy_least_request_tie_keeps_the_first_drawn() -> None:
    view = view_of(gpu("a", outstanding=2), gpu("b", outstanding=2), gpu("c", outstanding=1))
    pool = view.free[MODEL]
    index = {g.name: i for i, g in enumerate(pool)}

    def draw(*names: str) -> list[float]:
        return [(index[n] + 0.5) / len(pool) for n in names]

    picker = EnvoyLeastRequestPicker(Draws([*draw("b", "a"), *draw("a", "b")]), view)
    assert [g.name for g in picker.rank(request(), pool, 0.0)] == ["b", "a"]
    assert [g.name for g in picker.rank(request(), pool, 0.0)] == ["a", "b"]
    picker = EnvoyLeastRequestPicker(Draws(draw("b", "c")), view)
    assert first(picker, view) == "c"  # strictly fewer active requests


def test_envoy_weighted_earliest_deadline_shares_follow_weight() -> None:
    # Weights 2 and 1, nothing active: deadlines a 0.5, 1, 1.5, ...; b 1, 2, ...
    view = view_of(gpu("a", speed=2.0), gpu("b", speed=1.0))
    picker = EnvoyLeastRequestPicker(random.Random(1), view, weighted=True)
    picks = [first(picker, view) for _ in range(300)]
    assert picks[:3] == ["a", "b", "a"]  # a@0.5, then b@1.0 (older entry) before a@1.0
    assert Counter(picks) == {"a": 200, "b": 100}


def test_envoy_weighted_active_requests_lower_the_weight() -> None:
    # a: 2 / (3 + 1) = 0.5 against b: 1 / (0 + 1) = 1: b takes two picks in three.
    view = view_of(gpu("a", speed=2.0, outstanding=3), gpu("b", speed=1.0))
    picker = EnvoyLeastRequestPicker(random.Random(1), view, weighted=True)
    picks = Counter(first(picker, view) for _ in range(300))
    assert abs(picks["b"] - 200) <= 1


def test_envoy_weighted_skips_a_gpu_without_free_slot() -> None:
    view = view_of(gpu("a", speed=2.0, slots=1, outstanding=1), gpu("b", speed=1.0))
    picker = EnvoyLeastRequestPicker(random.Random(1), view, weighted=True)
    assert {first(picker, view) for _ in range(20)} == {"b"}


def test_queue_scores_normalise_between_min_and_max() -> None:
    assert queue_scores([4.0, 0.0, 2.0]) == [0.0, 1.0, 0.5]
    assert queue_scores([3.0, 3.0]) == [1.0, 1.0]


def report(view: LocalView, name: str, waiting: float, kv: float | None, at: float = 0.0) -> None:
    view.load.update(name, LoadSample(1.0, waiting, kv, taken_at=at, source="metrics"))


def test_inference_gateway_weights_queue_and_kv_scores() -> None:
    # queue: x 0, y 1, z 0.5; kv: x 0.8, y 0.1, z 0.5 -> totals x 1.6, y 2.2, z 2.0.
    view = view_of(gpu("x"), gpu("y"), gpu("z"))
    report(view, "x", 4, 0.2)
    report(view, "y", 0, 0.9)
    report(view, "z", 2, 0.5)
    ranked = InferenceGatewayPicker(view, random.Random(1)).rank(request(), view.free[MODEL], 0.0)
    assert [g.name for g in ranked] == ["y", "z", "x"]


def test_inference_gateway_prefix_weight_three_outweighs_load() -> None:
    # x is believed to hold 2 of the prompt's 4 blocks: 1.6 + 3 * 0.5 = 3.1 > y's 2.2.
    view = view_of(gpu("x"), gpu("y"), gpu("z"))
    report(view, "x", 4, 0.2)
    report(view, "y", 0, 0.9)
    report(view, "z", 2, 0.5)
    view.prefix.record((71, 72), "x")
    req = request(prompt_tokens=4 * BLOCK_TOKENS, prefix=(71, 72, 73, 74))
    assert first(InferenceGatewayPicker(view, random.Random(1)), view, req) == "x"


def test_inference_gateway_reads_a_stale_report_as_full_and_queued() -> None:
    # x's report is 5 s old (> 2 s): waiting = this tier's 3 in flight, KV = 1.0.
    # queue: x (3) 0, y (1) 1 -> x 0 + 0 = 0; y 2 + 2 * 0.6 = 3.2.
    view = view_of(gpu("x", outstanding=3), gpu("y"))
    report(view, "x", 0, 0.0, at=0.0)
    report(view, "y", 1, 0.4, at=4.0)
    ranked = InferenceGatewayPicker(view, random.Random(1)).rank(request(), view.free[MODEL], 5.0)
    assert [g.name for g in ranked] == ["y", "x"]


def test_make_picker_rejects_unknown_policy_naming_known_ones() -> None:
    with pytest.raises(ValueError, match="'fastest'") as err:
        make_picker("fastest", view_of(gpu("a")), random.Random(0))
    for name in POLICIES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_returns_only_pool_gpus(name: str) -> None:
    gpus = [gpu(f"g{i}", speed=1.0 + i % 3, outstanding=i % 4, slots=4) for i in range(12)]
    full = [g for g in gpus if g.outstanding_requests >= 3]
    for g in full:
        g.slots = g.outstanding_requests
    view = view_of(*gpus)
    view.prefix.record((1, 2, 3), full[0].name)
    view.prefix.record((1, 2), "g1")
    picker = make_picker(name, view, random.Random(5))
    pool = view.free[MODEL]
    assert len(pool) == len(gpus) - len(full)
    for i in range(50):
        req = request(prompt_tokens=48, prefix=(1, 2, 3)) if i % 2 else request()
        ranked = picker.rank(req, pool, float(i))
        assert ranked, name
        assert all(g in pool for g in ranked), name
        assert len({g.name for g in ranked}) == len(ranked), name
