"""CentralQueue under random operations: every granted slot reaches one live waiter."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from common.basics.vocabulary import PRIORITY_NAMES
from local_lb.queue_entries import QueuedRequest, QueueFull
from tests.local_lb.test_queue import make_queue, put, waiter

_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("enqueue"),
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["m1", "m2"]),
            st.sampled_from(PRIORITY_NAMES),
            st.integers(1, 50),
        ),
        st.tuples(
            st.just("offer"),
            st.sampled_from([frozenset({"m1"}), frozenset({"m2"}), frozenset({"m1", "m2"})]),
        ),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("yield")),
    ),
    max_size=60,
)


async def _run_ops(ops: list[tuple[object, ...]]) -> None:
    queue, released = make_queue(max_entries=5)
    tickets: list[QueuedRequest] = []
    tasks: list[asyncio.Task[str]] = []
    handed = 0
    for op in ops:
        match op:
            case ("enqueue", str(tenant), str(model), str(priority), int(cost)):
                try:
                    ticket = put(queue, tenant, model=model, priority=priority, cost=cost)
                except QueueFull:
                    continue
                tickets.append(ticket)
                tasks.append(asyncio.create_task(waiter(ticket)))
                await asyncio.sleep(0)
            case ("offer", frozenset() as models):
                pending = [i for i, t in enumerate(tickets) if not t.future.done()]
                ok = queue.offer("g", models)
                granted = [
                    i
                    for i in pending
                    if tickets[i].future.done()
                    and not tickets[i].future.cancelled()
                    and tickets[i].future.exception() is None
                ]
                assert len(granted) == (1 if ok else 0)
                if ok:
                    handed += 1
                    chosen = tickets[granted[0]]
                    assert not tasks[granted[0]].done() and chosen.model in models
                    rank = PRIORITY_NAMES.index
                    still_waiting = [tickets[i] for i in pending if not tickets[i].future.done()]
                    assert all(
                        rank(t.priority) >= rank(chosen.priority)
                        for t in still_waiting
                        if t.model in models
                    )
            case ("cancel", int(index)) if tasks:
                tasks[index % len(tasks)].cancel()
            case _:
                await asyncio.sleep(0)
        assert len(queue) <= 5
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    delivered = sum(isinstance(r, str) for r in results)
    assert handed == delivered + len(released)  # every slot reached a waiter or came back
    assert len(queue) == 0


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_every_granted_slot_reaches_exactly_one_live_waiter(ops: list[tuple[object, ...]]) -> None:
    asyncio.run(_run_ops(ops))
