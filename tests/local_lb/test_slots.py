"""SlotLedger: reserve/unreserve keep the zone's totals exact; recount after usability changes."""

from __future__ import annotations

from local_lb.publication import UtilisationBands
from local_lb.slots import SlotLedger
from local_lb.state import LocalView
from tests.local_lb.parts import M, gpus


def test_reserve_takes_a_slot_everywhere_and_unreserve_gives_it_back() -> None:
    view = LocalView(tuple(gpus(2, slots=2)))
    ledger = SlotLedger(view)
    g0 = view.by_name["g0"]
    ledger.reserve(g0)
    assert (g0.outstanding_requests, view.inflight_total, ledger.free_usable_slots) == (1, 1, 3)
    ledger.unreserve(g0)
    assert (g0.outstanding_requests, view.inflight_total, ledger.free_usable_slots) == (0, 0, 4)


def test_a_full_gpu_leaves_its_free_pool() -> None:
    view = LocalView(tuple(gpus(1, slots=1)))
    ledger = SlotLedger(view)
    ledger.reserve(view.by_name["g0"])
    assert len(view.free[M]) == 0


def test_slots_of_an_unusable_gpu_are_not_usable_after_a_recount() -> None:
    view = LocalView(tuple(gpus(2, slots=2)))
    ledger = SlotLedger(view)
    g1 = view.by_name["g1"]
    ledger.reserve(g1)
    g1.ejected = True
    ledger.recount()
    assert (ledger.total_slots, ledger.usable_slots, ledger.free_usable_slots) == (4, 2, 2)
    ledger.unreserve(g1)  # its busy slot was not counted as usable in flight
    assert ledger.free_usable_slots == 2


def test_reservations_report_utilisation_to_the_bands() -> None:
    calls: list[int] = []
    view = LocalView(tuple(gpus(1, slots=2)))
    ledger = SlotLedger(view, UtilisationBands(lambda: calls.append(1)))
    ledger.reserve(view.by_name["g0"])  # 50 %: a crossing
    assert len(calls) == 1
    ledger.unreserve(view.by_name["g0"])  # back to 0 %
    assert len(calls) == 2
