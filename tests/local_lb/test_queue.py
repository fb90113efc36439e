"""CentralQueue: strict priority, VTC fairness, deadlines, cancellation, shedding."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections import Counter

import pytest

from common.basics.vocabulary import PRIORITY_NAMES
from local_lb.queue import CentralQueue
from local_lb.queue_entries import QueuedRequest, QueueFull, QueueRejected, QueueTimeout

M = frozenset({"m"})


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_queue(
    *, max_entries: int = 10_000, clock: FakeClock | None = None
) -> tuple[CentralQueue, list[str]]:
    """A queue and the list of GPU names it handed back through ``release``."""
    released: list[str] = []
    queue = CentralQueue(
        release=released.append, max_entries=max_entries, clock=clock or time.monotonic
    )
    return queue, released


def put(
    queue: CentralQueue,
    tenant: str = "t",
    *,
    priority: str = "standard",
    cost: float = 10,
    model: str = "m",
    deadline: float | None = None,
) -> QueuedRequest:
    return queue.enqueue(
        model=model, tenant=tenant, priority=priority, cost_tokens=cost, deadline=deadline
    )


def serve(
    queue: CentralQueue, tickets: list[QueuedRequest], n: int, models: frozenset[str] = M
) -> list[QueuedRequest]:
    """Offer ``n`` slots; the tickets granted, in grant order."""
    pending, order = {t for t in tickets if not t.future.done()}, []
    for _ in range(n):
        assert queue.offer("g", models)
        granted = [t for t in pending if t.future.done()]
        assert len(granted) == 1
        order.append(granted[0])
        pending.discard(granted[0])
    return order


async def waiter(ticket: QueuedRequest) -> str:
    return await ticket.wait()


async def test_strict_priority_serves_critical_then_standard_then_sheddable() -> None:
    queue, _ = make_queue()
    tickets = [put(queue, f"t{i}", priority=p) for i in range(3) for p in reversed(PRIORITY_NAMES)]
    order = serve(queue, tickets, 9)
    assert [t.priority for t in order] == ["critical"] * 3 + ["standard"] * 3 + ["sheddable"] * 3
    assert not queue.offer("g", M)


async def test_fifo_within_one_tenant() -> None:
    queue, _ = make_queue()
    tickets = [put(queue, "a", cost=c) for c in (5, 50, 1, 20)]
    assert serve(queue, tickets, 4) == tickets


async def test_small_tenant_is_interleaved_with_a_large_backlog() -> None:
    queue, _ = make_queue()
    a = [put(queue, "a") for _ in range(100)]
    b = [put(queue, "b") for _ in range(10)]
    order = serve(queue, a + b, 110)
    positions = [order.index(t) for t in b]
    assert all(pos <= 2 * i + 2 for i, pos in enumerate(positions)), positions


async def test_weights_split_service_in_tokens() -> None:
    queue, _ = make_queue()
    queue.set_weight("a", 2.0)
    tickets = [put(queue, t, cost=c) for t in ("a", "b") for c in (7, 13, 30) for _ in range(100)]
    tokens: dict[str, float] = {"a": 0.0, "b": 0.0}
    for t in serve(queue, tickets, 300):
        tokens[t.tenant] += t.cost_tokens
    assert 1.8 <= tokens["a"] / tokens["b"] <= 2.2


async def test_fairness_counts_tokens_not_requests() -> None:
    queue, _ = make_queue()
    tickets = [put(queue, "big", cost=1000) for _ in range(200)]
    tickets += [put(queue, "small", cost=100) for _ in range(200)]
    served = Counter(t.tenant for t in serve(queue, tickets, 110))
    assert 9 <= served["big"] <= 11
    assert 99 <= served["small"] <= 101


async def test_late_tenant_is_lifted_to_the_backlogged_minimum() -> None:
    queue, _ = make_queue()
    a = [put(queue, "a") for _ in range(100)]
    serve(queue, a, 40)  # a's counter is now 400 tokens
    b = [put(queue, "b") for _ in range(40)]
    served = Counter(t.tenant for t in serve(queue, a + b, 20))
    assert 9 <= served["a"] <= 11  # b does not get 40 requests in a row


async def test_tenant_returning_to_an_empty_queue_cannot_bank_credit() -> None:
    queue, _ = make_queue()
    serve(queue, [put(queue, "a") for _ in range(50)], 50)  # queue empty; a's counter 500
    b = [put(queue, "b") for _ in range(10)]  # b idled meanwhile: lifted to 500
    a = [put(queue, "a") for _ in range(10)]
    served = Counter(t.tenant for t in serve(queue, a + b, 10))
    assert 4 <= served["a"] <= 6


async def test_offer_skips_entries_of_models_the_gpu_does_not_serve() -> None:
    queue, _ = make_queue()
    older = put(queue, model="m1", priority="critical")
    newer = put(queue, model="m2", priority="sheddable")
    assert not queue.offer("g", frozenset({"m3"}))
    assert queue.offer("g", frozenset({"m2"}))
    assert newer.future.result() == "g"
    assert not older.future.done()
    assert queue.depth_by_priority() == {"critical": 1, "standard": 0, "sheddable": 0}


async def test_waiter_times_out_at_its_deadline_without_any_offer() -> None:
    queue, _ = make_queue()
    start = time.monotonic()
    ticket = put(queue, deadline=start + 0.05)
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(ticket.wait(), 1.0)
    assert 0.04 <= time.monotonic() - start < 1.0
    assert len(queue) == 0
    assert ticket._timer is None


async def test_offer_never_goes_to_an_expired_entry() -> None:
    clock = FakeClock()
    queue, _ = make_queue(clock=clock)
    expired = put(queue, "a", deadline=clock.now + 5)  # its loop timer is 5 real seconds away
    fresh = put(queue, "a")
    clock.now += 10
    assert queue.offer("g", M)
    assert fresh.future.result() == "g"
    assert expired.future.done()
    with pytest.raises(QueueTimeout):
        await expired.wait()
    assert len(queue) == 0


async def test_cancelled_waiter_is_skipped_and_offer_goes_to_the_next() -> None:
    queue, _ = make_queue()
    first, second = put(queue, "a"), put(queue, "a")
    tasks = [asyncio.create_task(waiter(t)) for t in (first, second)]
    await asyncio.sleep(0)
    tasks[0].cancel()
    assert queue.offer("g", M)  # same loop turn: the cancellation has not been processed yet
    assert await asyncio.wait_for(tasks[1], 1.0) == "g"
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert len(queue) == 0


async def test_offer_returns_false_when_nothing_is_eligible() -> None:
    queue, _ = make_queue()
    assert not queue.offer("g", M)
    task = asyncio.create_task(waiter(put(queue)))
    await asyncio.sleep(0)
    task.cancel()
    assert not queue.offer("g", M)
    await asyncio.gather(task, return_exceptions=True)


async def test_grant_lost_to_cancellation_goes_back_through_release() -> None:
    queue, released = make_queue()
    tasks = [asyncio.create_task(waiter(put(queue, "a"))) for _ in range(2)]
    await asyncio.sleep(0)
    assert queue.offer("g", M)  # granted to the first...
    tasks[0].cancel()  # ...which is cancelled before it resumes
    await asyncio.sleep(0)
    assert released == ["g"]  # the slot's owner decides whether to offer it again
    assert not tasks[1].done()
    assert queue.offer("g", M)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 1.0)
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[1] == "g"


async def test_grant_lost_to_cancellation_with_no_other_waiter_is_released() -> None:
    queue, released = make_queue()
    task = asyncio.create_task(waiter(put(queue)))
    await asyncio.sleep(0)
    assert queue.offer("g", M)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert released == ["g"]


async def test_full_queue_refuses_a_sheddable_when_full_of_standard() -> None:
    queue, _ = make_queue(max_entries=3)
    standard = [put(queue) for _ in range(3)]
    with pytest.raises(QueueFull):
        put(queue, priority="sheddable")
    with pytest.raises(QueueFull):
        put(queue, priority="standard")
    assert len(queue) == 3
    assert not any(t.future.done() for t in standard)


async def test_critical_displaces_the_newest_sheddable() -> None:
    queue, _ = make_queue(max_entries=3)
    old, new = put(queue, priority="sheddable"), put(queue, priority="sheddable")
    put(queue, priority="standard")
    critical = put(queue, priority="critical")
    assert new.future.done()
    with pytest.raises(QueueRejected, match="shed for higher priority"):
        await new.wait()
    assert not old.future.done()
    assert queue.depth_by_priority() == {"critical": 1, "standard": 1, "sheddable": 1}
    assert queue.offer("g", M)
    assert critical.future.result() == "g"


async def test_full_queue_expires_an_overdue_entry_rather_than_shed_a_live_one() -> None:
    clock = FakeClock()
    queue, _ = make_queue(max_entries=2, clock=clock)
    live = put(queue, priority="sheddable")
    overdue = put(queue, priority="sheddable", deadline=clock.now + 5)
    clock.now += 10
    put(queue, priority="critical")
    assert overdue.future.done()
    with pytest.raises(QueueTimeout):
        await overdue.wait()
    assert not live.future.done()
    assert len(queue) == 2


async def test_expected_wait_counts_only_entries_ahead() -> None:
    queue, _ = make_queue()
    for priority, n in (("critical", 2), ("standard", 3), ("sheddable", 4)):
        for _ in range(n):
            put(queue, priority=priority)
    for _ in range(5):
        put(queue, model="other", priority="critical")
    assert queue.expected_wait_s("critical", "m", 2.0) == 1.0
    assert queue.expected_wait_s("standard", "m", 2.0) == 2.5
    assert queue.expected_wait_s("sheddable", "m", 2.0) == 4.5
    assert queue.expected_wait_s("standard", "unqueued", 2.0) == 0.0
    assert queue.expected_wait_s("standard", "m", 0.0) == float("inf")
    assert queue.depth_for_model("m") == 9


async def test_a_flooding_tenant_does_not_inflate_another_tenants_expected_wait() -> None:
    queue, _ = make_queue()
    for _ in range(100):
        put(queue, "flood")
    for _ in range(2):
        put(queue, "steady")
    # Without a tenant: all 102 ahead. Steady (equal weights) is served after its own 2,
    # flood taking one turn for each of steady's: 2 + 3 ahead.
    assert queue.expected_wait_s("standard", "m", 1.0) == 102.0
    assert queue.expected_wait_s("standard", "m", 1.0, tenant="steady") == 5.0
    assert queue.expected_wait_s("standard", "m", 1.0, tenant="newcomer") == 2.0
    # The flooder itself still sees its whole backlog.
    assert queue.expected_wait_s("standard", "m", 1.0, tenant="flood") == 102.0
    queue.set_weight("steady", 3.0)
    assert queue.expected_wait_s("standard", "m", 1.0, tenant="steady") == 3.0


async def test_introspection_counts_live_entries_and_oldest_wait() -> None:
    clock = FakeClock()
    queue, _ = make_queue(clock=clock)
    assert queue.oldest_wait_s(clock.now) == 0.0
    first = put(queue, priority="sheddable")
    clock.now += 3
    put(queue, priority="critical")
    assert len(queue) == 2
    assert queue.oldest_wait_s(clock.now + 1) == 4.0
    first.future.cancel()
    assert queue.oldest_wait_s(clock.now + 1) == 1.0
    assert queue.depth_by_priority() == {"critical": 1, "standard": 0, "sheddable": 0}


async def test_invalid_priority_cost_and_weight_are_refused() -> None:
    queue, _ = make_queue()
    with pytest.raises(ValueError, match="priority"):
        put(queue, priority="urgent")
    with pytest.raises(ValueError, match="cost_tokens"):
        put(queue, cost=0.5)
    with pytest.raises(ValueError, match="weight"):
        queue.set_weight("t", 0)


async def test_offer_passes_over_a_tenant_that_may_not_take_and_keeps_its_place() -> None:
    kept_out = {"flood"}
    queue = CentralQueue(release=lambda name: None, may_take=lambda t: t not in kept_out)
    flood = [put(queue, "flood") for _ in range(3)]
    steady = put(queue, "steady")
    assert queue.offer("g", M)
    assert steady.future.done() and steady.future.result() == "g"
    assert not any(t.future.done() for t in flood)
    assert not queue.offer("g", M)
    kept_out.clear()
    assert queue.offer("g", M)  # allowed again: flood's head is still first in line
    assert flood[0].future.done() and not flood[1].future.done()
    assert len(queue) == 2


async def test_offer_fails_an_entry_too_late_to_finish_before_its_deadline() -> None:
    clock = FakeClock()
    queue, _ = make_queue(clock=clock)
    doomed = queue.enqueue(
        model="m",
        tenant="a",
        priority="standard",
        cost_tokens=10,
        deadline=clock.now + 5.0,
        start_by=clock.now + 0.5,
    )
    hopeful = queue.enqueue(
        model="m",
        tenant="b",
        priority="standard",
        cost_tokens=10,
        deadline=clock.now + 5.0,
        start_by=clock.now + 4.0,
    )
    no_deadline = put(queue, "c")  # no start_by: only its wait bound applies
    clock.now += 1.0
    assert queue.offer("g", M)
    assert hopeful.future.result() == "g"
    with pytest.raises(QueueTimeout, match="too late to start"):
        await doomed.wait()
    assert queue.offer("g", M)
    assert no_deadline.future.result() == "g"
    assert len(queue) == 0


async def test_a_waiter_turned_away_is_freed_without_the_cyclic_gc() -> None:
    """A waiter that times out (or is shed) is raised the error its future keeps:
    raised as it is, the error's traceback holds the waiter's frame, and so the entry
    and its future, a cycle per request turned away that only the cyclic GC frees
    (under overload, when there are most of them)."""
    queue, _ = make_queue()
    gc.disable()
    try:
        tickets = [put(queue, deadline=time.monotonic() + 0.01) for _ in range(20)]
        timed_out = 0
        for ticket in tickets:
            try:  # awaited here: wait_for's task would keep the error in a cycle of its own
                await ticket.wait()
            except QueueTimeout:
                timed_out += 1
        assert timed_out == 20 and len(queue) == 0
        entries = [weakref.ref(ticket) for ticket in tickets]
        del tickets, ticket
        await asyncio.sleep(0)  # the futures' done callbacks, which hold them, run
        # The queue lets go of settled entries lazily (a few may still be in a lane);
        # those it let go of are freed at once, and the cyclic GC finds none of them.
        kept = [entry for entry in entries if entry() is not None]
        gc.collect()
        freed_by_gc = sum(entry() is None for entry in kept)
    finally:
        gc.enable()
    assert len(kept) < len(entries) and freed_by_gc == 0
