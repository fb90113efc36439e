"""LocalBalancer: slots, late binding, shedding, ejection and slow start timelines."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from common.basics.errors import RETRY_AFTER_MS, RouteError
from common.basics.vocabulary import Priority
from common.config.node import Endpoint
from common.request.balancer import Outcome
from common.request.children import ChildSet
from common.request.health import GpuCheck
from common.request.pick import PickRequest
from common.request.resilience import SlowStartConfig
from local_lb.balancer import LocalBalancer
from local_lb.picker import CompletionTimePicker
from local_lb.state import GpuChild, LocalView

M = "m"
OK = grpc.StatusCode.OK


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(
    n: int = 2,
    slots: int = 1,
    *,
    clock: Clock | None = None,
    versions: dict[str, frozenset[str]] | None = None,
    tenant_headroom: float = 0.0,
) -> LocalBalancer:
    clock = clock or Clock()
    gpus = tuple(
        GpuChild(
            name=f"g{i}",
            endpoint=Endpoint("127.0.0.1", 1),
            models=frozenset({M}),
            slots=slots,
            rate=2000.0,
            versions=versions or {},
        )
        for i in range(n)
    )
    view = LocalView(gpus)
    children = ChildSet(
        gpus, probe_interval_s=1, summary_ttl_s=3, kind="GPU", probe=False, clock=clock
    )
    return LocalBalancer(
        view=view,
        picker_factory=lambda v: CompletionTimePicker(v, rng=random.Random(1)),
        children=children,
        slow_start_config=SlowStartConfig(window_s=30.0),
        tenant_headroom=tenant_headroom,
        clock=clock,
    )


def pick(
    priority: Priority = Priority.STANDARD, tenant: str = "t", version: str = ""
) -> PickRequest:
    return PickRequest(M, version, None, None, priority, 10, 20, tenant=tenant)


def ok(elapsed: float = 0.1) -> Outcome:
    return Outcome(OK, elapsed)


async def test_reserves_distinct_gpus_until_full() -> None:
    bal = make(n=2, slots=1)
    a = await bal.acquire(pick(), (), None)
    b = await bal.acquire(pick(), (), None)
    assert {a.child.name, b.child.name} == {"g0", "g1"}
    assert len(bal.view.free[M]) == 0


async def test_late_binding_to_the_first_gpu_that_frees_a_slot() -> None:
    bal = make(n=2, slots=1)
    first = await bal.acquire(pick(), (), None)
    await bal.acquire(pick(), (), None)
    waiter = asyncio.create_task(bal.acquire(pick(), (), 5.0))
    await asyncio.sleep(0)
    assert not waiter.done() and len(bal.queue) == 1
    bal.release(first, ok())
    lease = await asyncio.wait_for(waiter, 1)
    assert lease.child is first.child
    assert first.child.outstanding_requests == 1  # the slot passed straight to the waiter


async def test_queue_serves_critical_before_standard() -> None:
    bal = make(n=1, slots=1)
    held = await bal.acquire(pick(), (), None)
    standard = asyncio.create_task(bal.acquire(pick(Priority.STANDARD), (), 5.0))
    await asyncio.sleep(0)
    critical = asyncio.create_task(bal.acquire(pick(Priority.CRITICAL), (), 5.0))
    await asyncio.sleep(0)
    bal.release(held, ok())
    await asyncio.wait_for(critical, 1)
    assert not standard.done()
    standard.cancel()


async def test_sheds_with_retry_after_when_the_wait_exceeds_the_deadline() -> None:
    bal = make(n=1, slots=1)
    await bal.acquire(pick(), (), None)
    waiters = [asyncio.create_task(bal.acquire(pick(), (), 60.0)) for _ in range(5)]
    await asyncio.sleep(0)
    with pytest.raises(RouteError) as err:
        await bal.acquire(pick(), (), 0.01)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = dict(err.value.trailers)[RETRY_AFTER_MS]
    assert int(retry) > 10
    assert "expected queue wait" in err.value.message
    assert len(bal.queue) == 5  # the shed request was never queued
    for w in waiters:
        w.cancel()


async def test_deadline_spent_in_the_queue() -> None:
    bal = make(n=1, slots=1)
    await bal.acquire(pick(), (), None)
    with pytest.raises(RouteError) as err:
        await bal.acquire(pick(), (), 0.05)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(bal.queue) == 0


async def test_cancelled_waiter_leaks_no_slot() -> None:
    bal = make(n=1, slots=1)
    held = await bal.acquire(pick(), (), None)
    waiter = asyncio.create_task(bal.acquire(pick(), (), 5.0))
    await asyncio.sleep(0)
    waiter.cancel()
    bal.release(held, ok())
    await asyncio.sleep(0)
    gpu = bal.view.by_name["g0"]
    assert gpu.outstanding_requests == 0 and gpu in bal.view.free[M]


async def test_unknown_version_is_not_found() -> None:
    bal = make(versions={M: frozenset({"1", "2"})})
    with pytest.raises(RouteError) as err:
        await bal.acquire(pick(version="7"), (), None)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert (await bal.acquire(pick(version="2"), (), None)).child.name in {"g0", "g1"}


async def test_no_healthy_gpu_is_unavailable() -> None:
    bal = make(n=2)
    for gpu in bal.view.gpus:
        bal.readiness.probed(gpu.name, GpuCheck(False, "probe failed"))
    with pytest.raises(RouteError) as err:
        await bal.acquire(pick(), (), None)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "probe failed" in err.value.message


async def test_ejection_after_five_failures_then_return_with_slow_start() -> None:
    clock = Clock()
    bal = make(n=20, slots=4, clock=clock)
    bad = bal.view.by_name["g0"]
    for i in range(5):
        lease = await bal.acquire(pick(), [g.name for g in bal.view.gpus if g is not bad], None)
        assert lease.child is bad
        bal.release(lease, Outcome(grpc.StatusCode.INTERNAL, 0.01, detail=f"boom {i}"))
    assert bad.ejected and bad not in bal.view.free[M]
    clock.now += 29.0
    bal.refresh_all()
    assert bad.ejected
    clock.now += 1.5  # 30 s ejection over
    bal.refresh_all()
    assert not bad.ejected and bad in bal.view.free[M]
    assert bad.share == pytest.approx(0.1, abs=0.02)  # slow start from the 10% floor
    clock.now += 15.0
    bal.refresh_all()
    assert bad.share == pytest.approx(0.5, abs=0.02)
    clock.now += 16.0
    bal.refresh_all()
    assert bad.share == 1.0


async def test_learns_the_service_rate_from_finished_requests() -> None:
    bal = make(n=1, slots=4)
    gpu = bal.view.by_name["g0"]
    before = gpu.rate
    for _ in range(20):
        lease = await bal.acquire(pick(), (), None)
        bal.release(lease, ok(elapsed=lease.work / 500.0))  # a GPU doing 500 work/s alone
    assert gpu.rate < before
    assert gpu.rate == pytest.approx(500.0, rel=0.1)


async def test_reserved_headroom_keeps_slots_free_for_a_light_tenant() -> None:
    # 8 slots, headroom 0.5: a heavy tenant may not take the last 4 while a light
    # tenant is active; the light one binds at once.
    bal = make(n=2, slots=4, tenant_headroom=0.5)
    warm = await bal.acquire(pick(tenant="steady"), (), None)
    bal.release(warm, ok(1.0))  # 1 s per request of 30 tokens: the zone does 240 tokens/s
    bal.tenants.arrived("flood", 2000.0)  # it has been sending ~1000 tokens/s, its share is 120
    steady = await bal.acquire(pick(tenant="steady"), (), None)
    flood = [await bal.acquire(pick(tenant="flood"), (), None) for _ in range(3)]
    blocked = [asyncio.create_task(bal.acquire(pick(tenant="flood"), (), 30.0)) for _ in range(3)]
    await asyncio.sleep(0)
    assert len(bal.queue) == 3 and bal.view.inflight_total == 4  # 4 slots stay free
    late = await bal.acquire(pick(tenant="steady"), (), None)
    assert late.queued_s is None  # bound at once
    # A flood slot frees up: 4 free, taking one would leave fewer than the reserve...
    bal.release(flood[0], ok())
    await asyncio.sleep(0)
    assert bal.view.inflight_total == 4 and len(bal.queue) == 3
    # ...but once the light tenant has left (and its window passed), the flood fills up.
    bal.release(steady, ok())
    bal.release(late, ok())
    bal.clock.now += 10.0  # type: ignore[attr-defined]
    bal.refresh_all()
    leases = await asyncio.wait_for(asyncio.gather(*blocked), 1)
    assert bal.view.inflight_total == 5
    assert {lease.reason for lease in leases} == {"reserved headroom"}


async def test_without_headroom_a_flood_takes_every_slot() -> None:
    bal = make(n=2, slots=4)
    await bal.acquire(pick(tenant="steady"), (), None)
    for _ in range(7):
        await bal.acquire(pick(tenant="flood"), (), None)
    assert bal.view.inflight_total == 8


async def test_queued_requests_fail_over_at_once_when_no_gpu_can_serve_any_more() -> None:
    bal = make(n=1, slots=1)
    await bal.acquire(pick(), (), None)
    waiter = asyncio.create_task(bal.acquire(pick(), (), 30.0))
    await asyncio.sleep(0)
    assert len(bal.queue) == 1
    bal.readiness.probed("g0", GpuCheck(False, "gone"))
    with pytest.raises(RouteError) as err:
        await asyncio.wait_for(waiter, 1)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE  # the tier above tries another zone
    assert "g0" in err.value.message
    assert len(bal.queue) == 0


async def test_slots_on_an_unusable_gpu_do_not_count_as_taken_headroom() -> None:
    # g1 is ejected with its 2 slots still busy; g0 is idle. The reserve is 1 of g0's
    # 2 slots, so the heavy flood may take the other one: g1's busy slots do not count.
    bal = make(n=2, slots=2, tenant_headroom=0.5)
    held = [await bal.acquire(pick(tenant="flood"), (), None) for _ in range(4)]
    for lease in held:
        if lease.child.name == "g0":
            bal.release(lease, ok())
    for _ in range(5):  # consecutive failures: the outlier detector ejects g1
        bal.resilience.record_failure("g1")
    assert bal.view.by_name["g1"].ejected
    assert bal.free_usable_slots == 2
    bal.tenants.arrived("flood", 5000.0)  # far over its share
    bal.tenants.arrived("steady", 30.0)  # a light tenant is active
    bal.clock.now += 0.1  # type: ignore[attr-defined]  # past the cached classification
    lease = await bal.acquire(pick(tenant="flood"), (), None)
    assert lease.child.name == "g0" and lease.queued_s is None
    waiter = asyncio.create_task(bal.acquire(pick(tenant="flood"), (), 5.0))
    await asyncio.sleep(0)
    assert not waiter.done() and len(bal.queue) == 1  # the last free slot is the reserve
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


async def test_a_queued_request_waits_for_a_gpu_serving_its_version() -> None:
    bal = make(n=2, slots=1, versions={M: frozenset({"1"})})
    bal.view.by_name["g1"].versions = {M: frozenset({"2"})}
    bal.view._serving.clear()
    v1 = await bal.acquire(pick(version="1"), (), None)
    await bal.acquire(pick(version="2"), (), None)
    waiter = asyncio.create_task(bal.acquire(pick(version="2"), (), 5.0))
    await asyncio.sleep(0)
    bal.release(v1, ok())  # g0 frees a slot, but it serves version 1 only
    await asyncio.sleep(0)
    assert not waiter.done() and bal.view.by_name["g0"].outstanding_requests == 0
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


async def test_a_grant_lost_to_cancellation_is_not_passed_on_by_a_drained_gpu() -> None:
    bal = make(n=2, slots=1)
    held = [await bal.acquire(pick(), (), None) for _ in range(2)]
    first = asyncio.create_task(bal.acquire(pick(), (), 5.0))
    second = asyncio.create_task(bal.acquire(pick(), (), 5.0))
    await asyncio.sleep(0)
    on_g0 = next(lease for lease in held if lease.child.name == "g0")
    bal.release(on_g0, ok())  # g0's slot is granted to the first waiter...
    g0 = bal.view.by_name["g0"]
    bal.children.set_drained(g0, True)  # ...g0 is drained...
    first.cancel()  # ...and the first waiter is cancelled before it resumes
    await asyncio.sleep(0.01)
    assert not second.done() and g0.outstanding_requests == 0
    on_g1 = next(lease for lease in held if lease.child.name == "g1")
    bal.release(on_g1, ok())
    lease = await asyncio.wait_for(second, 1)
    assert lease.child.name == "g1"
    await asyncio.gather(first, return_exceptions=True)


async def test_a_weighted_gpus_lease_estimate_is_the_pickers_cost() -> None:
    bal = make(n=1, slots=4)
    gpu = bal.view.by_name["g0"]
    gpu.weight, gpu.share = 3.0, 0.5
    await bal.acquire(pick(), (), None)  # some work already in flight there
    picker = bal.picker
    assert isinstance(picker, CompletionTimePicker)
    expected = picker.cost(gpu, pick(), 0, bal.clock())
    lease = await bal.acquire(pick(), (), None)
    assert lease.child is gpu
    assert lease.estimated_s == pytest.approx(expected)


async def test_set_gpus_rebuilds_the_picker_only_when_the_gpu_set_changes() -> None:
    bal = make(n=3)
    picker = bal.picker
    bal.set_gpus(bal.view.gpus)  # same GPUs, settings changed perhaps
    assert bal.picker is picker
    bal.set_gpus(bal.view.gpus[:2])
    assert bal.picker is not picker and "g2" not in bal.view.by_name
    assert bal.free_usable_slots == 2  # slot totals follow the new set


async def test_set_gpus_moves_the_ejection_cap_with_the_gpu_count() -> None:
    bal = make(n=1)
    more = tuple(
        GpuChild(name=f"h{i}", endpoint=Endpoint("127.0.0.1", 1), models=frozenset({M}))
        for i in range(20)
    )
    bal.set_gpus((*bal.view.gpus, *more))  # 21 GPUs: 10 % lets two be ejected at once
    for name in ("h0", "h1"):
        for _ in range(5):
            bal.resilience.record_failure(name)
    assert bal.ejected_gpus() == {"h0", "h1"}


async def test_forget_drops_a_gpu_from_resilience_load_reports_and_prefix_index() -> None:
    bal = make(n=2)
    for _ in range(5):
        bal.resilience.record_failure("g1")
    bal.view.prefix.record([1, 2], "g1")
    bal.forget("g1")
    assert bal.ejected_gpus() == frozenset()
    assert bal.view.prefix.matches([1, 2]) == {}


async def test_a_band_crossing_calls_the_callback_given_at_construction() -> None:
    calls: list[int] = []
    clock = Clock()
    gpus = (GpuChild(name="g0", endpoint=Endpoint("127.0.0.1", 1), models=frozenset({M})),)
    view = LocalView(gpus)
    children = ChildSet(
        gpus, probe_interval_s=1, summary_ttl_s=3, kind="GPU", probe=False, clock=clock
    )
    bal = LocalBalancer(
        view=view,
        picker_factory=lambda v: CompletionTimePicker(v, rng=random.Random(1)),
        children=children,
        tenant_weights={"gold": 4.0},
        on_significant_change=lambda: calls.append(1),
        clock=clock,
    )
    for _ in range(8):  # 8 of 16 slots: utilisation reaches the 50 % band
        await bal.acquire(pick(), (), None)
    assert calls == [1]
    assert bal.queue.weight("gold") == 4.0
    assert bal.queue_depths() == {"critical": 0, "standard": 0, "sheddable": 0}
