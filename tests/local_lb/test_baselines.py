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
    LeastConnectionsPicker,
    LeastResponseTimePicker,
    PowerOfTwoPicker,
    RoundRobinPicker,
    SglangCacheAwarePicker,
    WeightedRoundRobinPicker,
)
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
