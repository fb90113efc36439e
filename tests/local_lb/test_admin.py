"""The local tier's admin hooks: drained GPUs leave the pools, weights scale the cost,
reload adds, forgets and updates GPUs."""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any

import grpc

from common.basics.vocabulary import Priority
from common.config.node import Endpoint
from common.config.topology import topology_from_mapping
from common.request.balancer import Outcome
from common.request.children import ChildSet
from common.request.pick import PickRequest
from local_lb.admin import LocalAdmin
from local_lb.balancer import LocalBalancer
from local_lb.load import MonitoredGpu
from local_lb.load_book import LoadSample
from local_lb.picker import CompletionTimePicker
from local_lb.policies import make_picker
from local_lb.server import gpu_child
from local_lb.state import GpuChild, LocalView
from sim.topology import one_zone_mapping
from tests.local_lb.test_balancer import Clock, pick

M = "m"


def gpus(n: int = 2) -> tuple[GpuChild, ...]:
    return tuple(
        GpuChild(
            name=f"g{i}", endpoint=Endpoint("127.0.0.1", 1), models=frozenset({M}), rate=2000.0
        )
        for i in range(n)
    )


def request() -> PickRequest:
    return PickRequest(M, "", None, None, Priority.STANDARD, 10, 20)


def test_a_drained_gpu_leaves_the_free_pool_and_comes_back_when_undrained() -> None:
    view = LocalView(gpus())
    children = ChildSet(view.gpus, probe_interval_s=1, summary_ttl_s=3, probe=False)

    def refresh() -> None:
        for gpu in view.gpus:
            view.refresh(gpu)

    children.add_listener(refresh)
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


class FakeMonitor:
    """The part of BackendMonitor the admin hooks use; records what they asked."""

    def __init__(self, gpus: list[MonitoredGpu]) -> None:
        self.gpus = {g.name: g for g in gpus}
        self.removed: list[str] = []
        self.updated: list[MonitoredGpu] = []

    def add(self, gpu: MonitoredGpu) -> None:
        self.gpus[gpu.name] = gpu

    async def remove(self, name: str) -> None:
        self.removed.append(name)
        self.gpus.pop(name)

    def watched(self, name: str) -> MonitoredGpu | None:
        return self.gpus.get(name)

    async def update(self, gpu: MonitoredGpu) -> None:
        if self.gpus[gpu.name] != gpu:
            self.updated.append(gpu)
        self.gpus[gpu.name] = gpu


def zone_mapping(gpus: int = 3) -> dict[str, Any]:
    return one_zone_mapping("redis://127.0.0.1:1/0", gpus=gpus, model=M, max_concurrency=2)


def local_tier(
    mapping: dict[str, Any], clock: Clock
) -> tuple[LocalAdmin, LocalBalancer, FakeMonitor]:
    topology = topology_from_mapping(mapping)
    configs = topology.zone("r", "r-1a").gpus
    children_ = tuple(gpu_child(g) for g in configs)
    view = LocalView(children_)
    children = ChildSet(
        children_, probe_interval_s=1, summary_ttl_s=3, kind="GPU", probe=False, clock=clock
    )
    rng = random.Random(1)
    balancer = LocalBalancer(
        view=view,
        picker_factory=lambda v: make_picker("default", v, rng),
        children=children,
        clock=clock,
        rng=rng,
    )
    monitor = FakeMonitor([MonitoredGpu.from_config(g) for g in configs])
    hooks = LocalAdmin(
        region="r",
        zone="r-1a",
        children=children,
        view=view,
        balancer=balancer,
        monitor=monitor,  # type: ignore[arg-type]
        make_gpu=gpu_child,
    )
    return hooks, balancer, monitor


async def wait_gone(children: ChildSet, name: str) -> None:
    for _ in range(100):
        if name not in children.by_name:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name} was not retired")


async def test_a_removed_ejected_gpu_is_forgotten_and_a_later_ejection_works() -> None:
    clock = Clock()
    mapping = zone_mapping(3)
    hooks, bal, monitor = local_tier(mapping, clock)
    for _ in range(5):
        bal.resilience.record_failure("g2")
    assert bal.view.by_name["g2"].ejected and bal.resilience.ejected_keys() == {"g2"}
    bal.view.load.update("g2", LoadSample(1, 0, None, clock(), "metrics"))
    bal.resilience.slow_start.start("g2")
    fewer = copy.deepcopy(mapping)
    fewer["regions"][0]["zones"][0]["gpus"].pop()
    report = await hooks.reload(topology_from_mapping(fewer))
    assert list(report.removed) == ["g2"]
    await wait_gone(bal.children, "g2")
    assert monitor.removed == ["g2"] and "g2" not in bal.view.by_name
    assert bal.resilience.ejected_keys() == frozenset()
    assert bal.view.load.get("g2", clock(), 60) is None
    assert bal.resilience.slow_start.factor("g2") == 1.0
    clock.now += 3600  # g2's ejection would have run out by now
    for _ in range(5):  # and another GPU fails its way to an ejection
        lease = await bal.acquire(pick(), ("g0",), None)
        assert lease.child.name == "g1"
        bal.release(lease, Outcome(grpc.StatusCode.INTERNAL, 0.1))
    assert bal.resilience.ejected_keys() == {"g1"} and bal.view.by_name["g1"].ejected
    assert bal.view.inflight_total == 0 and bal.breaker.pending("g1") == 0
    assert bal.view.by_name["g1"].outstanding_requests == 0
    await bal.children.stop()


async def test_a_kept_gpu_takes_new_models_and_metrics_and_the_monitor_follows() -> None:
    clock = Clock()
    mapping = zone_mapping(2)
    hooks, bal, monitor = local_tier(mapping, clock)
    picker = bal.picker
    report = await hooks.reload(topology_from_mapping(mapping))  # nothing changed
    assert not (report.added or report.removed or report.changed)
    assert bal.picker is picker and monitor.updated == []
    changed = copy.deepcopy(mapping)
    g0 = changed["regions"][0]["zones"][0]["gpus"][0]
    g0["models"] = [M, "n"]
    g0["metrics_listen"] = "127.0.0.1:9"
    report = await hooks.reload(topology_from_mapping(changed))
    assert "g0: metrics http://" in "; ".join(report.changed)
    [watched] = monitor.updated
    assert watched.models == {M, "n"} and watched.metrics_url == "http://127.0.0.1:9/metrics"
    address = mapping["regions"][0]["zones"][0]["gpus"][0]["listen"]
    assert watched.address == address
    assert [g.name for g in bal.view.free["n"]] == ["g0"]
    assert bal.picker is picker  # same GPUs: the session ring stays
    await bal.children.stop()


async def test_a_kept_gpus_new_tls_is_reported_not_applied() -> None:
    """Its channel is open: like an address, a GPU's ``tls`` is taken when it is added."""
    mapping = zone_mapping(2)
    hooks, bal, _ = local_tier(mapping, Clock())
    changed = copy.deepcopy(mapping)
    changed["regions"][0]["zones"][0]["gpus"][0]["tls"] = {"ca": __file__}
    report = await hooks.reload(topology_from_mapping(changed))
    assert list(report.not_applied) == ["g0: tls (add it under a new name instead)"]
    assert bal.view.by_name["g0"].tls is None
    await bal.children.stop()
