"""QueueHandOff: freed slots go to waiters of served models; unservable waiters fail now."""

from __future__ import annotations

import asyncio

import pytest

from common.request.children import ChildSet
from local_lb.handoff import QueueHandOff
from local_lb.queue_entries import QueueUnserved, queue_key
from local_lb.slots import SlotLedger
from local_lb.state import LocalView
from tests.local_lb.parts import Clock, M, gpus


def rig(
    n: int = 1, slots: int = 1, may_take: bool = True
) -> tuple[QueueHandOff, SlotLedger, LocalView]:
    clock = Clock()
    view = LocalView(tuple(gpus(n, slots=slots)))
    children = ChildSet(
        view.gpus, probe_interval_s=1, summary_ttl_s=3, kind="GPU", probe=False, clock=clock
    )
    ledger = SlotLedger(view)
    hand_off = QueueHandOff(
        view=view,
        slots=ledger,
        children=children,
        may_take=lambda tenant: may_take,
        tenant_weights={"heavy": 2.0},
        clock=clock,
    )
    return hand_off, ledger, view


def wait(hand_off: QueueHandOff, model: str = M, tenant: str = "t") -> asyncio.Future[str]:
    ticket = hand_off.queue.enqueue(
        model=model, tenant=tenant, priority="standard", cost_tokens=10.0
    )
    return asyncio.ensure_future(ticket.wait())


async def test_a_freed_slot_goes_to_the_waiter_and_is_reserved_for_it() -> None:
    hand_off, ledger, view = rig()
    g0 = view.by_name["g0"]
    waiter = wait(hand_off)
    hand_off.offer_free_slots(g0)
    assert await waiter == "g0"
    assert g0.outstanding_requests == 1 and ledger.free_usable_slots == 0


async def test_a_gpu_only_takes_waiters_of_models_it_serves() -> None:
    hand_off, _, view = rig()
    waiter = wait(hand_off, model=queue_key("other"))
    hand_off.offer_free_slots(view.by_name["g0"])
    await asyncio.sleep(0)
    assert not waiter.done() and len(hand_off.queue) == 1
    waiter.cancel()


async def test_an_unusable_gpu_hands_out_nothing() -> None:
    hand_off, _, view = rig()
    g0 = view.by_name["g0"]
    g0.drained = True
    waiter = wait(hand_off)
    hand_off.offer_free_slots(g0)
    await asyncio.sleep(0)
    assert not waiter.done()
    waiter.cancel()


async def test_an_abandoned_grant_frees_the_slot_and_offers_it_again() -> None:
    hand_off, _, view = rig()
    g0 = view.by_name["g0"]
    first, second = wait(hand_off, tenant="a"), wait(hand_off, tenant="b")
    await asyncio.sleep(0)
    hand_off.offer_free_slots(g0)  # granted to the first ...
    first.cancel()  # ... which is cancelled before it could resume
    await asyncio.gather(first, return_exceptions=True)
    assert await second == "g0"
    assert g0.outstanding_requests == 1  # one slot, held by the second waiter


async def test_waiters_of_a_model_no_usable_gpu_serves_fail_at_once() -> None:
    hand_off, _, view = rig()
    waiter = wait(hand_off)
    view.by_name["g0"].ejected = True
    hand_off.fail_unservable()
    with pytest.raises(QueueUnserved):
        await waiter
    assert len(hand_off.queue) == 0


async def test_the_tenant_weights_given_at_construction_reach_the_queue() -> None:
    hand_off, _, _ = rig()
    assert hand_off.queue.weight("heavy") == 2.0 and hand_off.queue.weight("other") == 1.0
