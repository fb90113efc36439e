"""The local tier's admin hooks: drained GPUs leave the pools, weights scale the cost."""

from __future__ import annotations

import random

from common.children import ChildSet
from common.config import Endpoint
from common.pick import PickRequest
from local_lb.picker import CompletionTimePicker
from local_lb.state import GpuChild, LocalView

M = "m"


def gpus(n: int = 2) -> tuple[GpuChild, ...]:
    return tuple(
        GpuChild(
            name=f"g{i}", endpoint=Endpoint("127.0.0.1", 1), models=frozenset({M}), rate=2000.0
        )
        for i in range(n)
    )


def request() -> PickRequest:
    return PickRequest(M, "", None, None, "standard", 10, 20)


def test_a_drained_gpu_leaves_the_free_pool_and_comes_back_when_undrained() -> None:
    view = LocalView(gpus())
    children = ChildSet(view.gpus, probe_interval_s=1, summary_ttl_s=3, probe=False)
    children.add_listener(lambda: [view.refresh(g) for g in view.gpus])
    g0 = view.by_name["g0"]
    children.set_drained(g0, True)
    assert not g0.usable and g0.healthy
    assert [g.name for g in view.free[M]] == ["g1"]
    children.set_drained(g0, False)
    assert {g.name for g in view.free[M]} == {"g0", "g1"}


def test_weight_scales_the_learned_rate_in_the_cost() -> None:
    view = LocalView(gpus())
    picker = CompletionTimePicker(view, rng=random.Random(1))
    g0, g1 = view.by_name["g0"], view.by_name["g1"]
    g0.outstanding_requests, g0.outstanding_work = 2, 60.0  # g0 is busier
    assert picker.rank(request(), view.free[M], 0.0)[0] is g1
    g0.weight = 50.0  # ... but looks fifty times as fast
    assert picker.cost(g0, request(), 0, 0.0) < picker.cost(g1, request(), 0, 0.0)
    assert picker.rank(request(), view.free[M], 0.0)[0] is g0


def test_set_gpus_reindexes_pools_for_added_and_removed_gpus() -> None:
    view = LocalView(gpus(2))
    extra = GpuChild(name="g9", endpoint=Endpoint("127.0.0.1", 1), models=frozenset({M, "n"}))
    view.set_gpus([view.by_name["g1"], extra])
    assert set(view.by_name) == {"g1", "g9"}
    assert {g.name for g in view.free[M]} == {"g1", "g9"} and [g.name for g in view.free["n"]] == [
        "g9"
    ]
    assert view.serving("n") == (extra,)
