"""UtilisationBands and LateBoundCallback: a callback on band crossings, connected late."""

from __future__ import annotations

import pytest

from local_lb.publication import LateBoundCallback, UtilisationBands


def test_a_crossing_calls_back_once_and_staying_in_a_band_does_not() -> None:
    calls: list[int] = []
    bands = UtilisationBands(lambda: calls.append(1))
    bands.observe(1, 10)  # 10 %: still band 0
    assert calls == []
    bands.observe(5, 10)  # 50 %: band 1
    bands.observe(6, 10)  # 60 %: still band 1
    assert len(calls) == 1 and bands.band == 1


def test_falling_back_below_an_edge_is_a_crossing_too() -> None:
    calls: list[int] = []
    bands = UtilisationBands(lambda: calls.append(1))
    bands.observe(10, 10)
    bands.observe(0, 10)
    assert len(calls) == 2 and bands.band == 0


def test_no_slots_at_all_reads_as_a_one_slot_zone_not_a_division_by_zero() -> None:
    calls: list[int] = []
    bands = UtilisationBands(lambda: calls.append(1))
    bands.observe(1, 0)
    assert bands.band == 4 and len(calls) == 1


def test_a_late_bound_callback_does_nothing_until_connected_then_calls_its_target() -> None:
    calls: list[int] = []
    late = LateBoundCallback()
    late()
    late.connect(lambda: calls.append(1))
    late()
    assert calls == [1]


def test_a_late_bound_callback_is_connected_once() -> None:
    late = LateBoundCallback()
    late.connect(lambda: None)
    with pytest.raises(RuntimeError):
        late.connect(lambda: None)
