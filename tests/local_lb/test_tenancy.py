"""Reserved headroom: who may take the zone's last free slots (local_lb.tenancy)."""

from __future__ import annotations

import pytest

from local_lb.tenancy import TenantHeadroom


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def make(
    headroom: float = 0.5,
    queued: dict[str, int] | None = None,
    weights: dict[str, float] | None = None,
) -> tuple[TenantHeadroom, Clock]:
    clock = Clock()
    waiting = queued if queued is not None else {}
    w = weights or {}
    shares = TenantHeadroom(
        headroom,
        window_s=1.0,
        queued=lambda: waiting,
        weight=lambda t: w.get(t, 1.0),
        clock=clock,
    )
    return shares, clock


def hold(shares: TenantHeadroom, tenant: str, n: int) -> None:
    for _ in range(n):
        shares.took(tenant)


def test_anyone_takes_a_slot_above_the_headroom() -> None:
    shares, _ = make(0.5, queued={"flood": 100})
    hold(shares, "flood", 10)
    hold(shares, "steady", 2)
    # 16 usable, 5 free: taking one leaves 4 < 8, but 9 free leaves 8 = the reserve.
    assert shares.may_take("flood", 9, 16)
    assert not shares.may_take("flood", 8, 16)


def test_heavy_tenant_kept_out_of_the_headroom_while_a_light_one_is_active() -> None:
    shares, _ = make(0.5, queued={"flood": 100})
    hold(shares, "flood", 6)
    hold(shares, "steady", 2)
    assert not shares.may_take("flood", 8, 16)
    assert shares.may_take("steady", 8, 16)  # light: its demand is below its share
    assert shares.may_take("steady", 1, 16)  # down to the very last slot


def test_work_conserving_when_every_active_tenant_is_heavy() -> None:
    shares, _ = make(0.5, queued={"a": 20, "b": 20})
    hold(shares, "a", 4)
    hold(shares, "b", 4)
    assert shares.may_take("a", 8, 16)
    assert shares.may_take("b", 1, 16)


def test_a_lone_tenant_may_fill_the_zone() -> None:
    shares, _ = make(0.5, queued={"flood": 100})
    hold(shares, "flood", 15)
    assert shares.may_take("flood", 1, 16)


def test_protection_ends_a_window_after_the_light_tenant_left() -> None:
    shares, clock = make(0.5, queued={"flood": 100})
    hold(shares, "flood", 6)
    shares.took("steady")
    shares.gave_back("steady")
    assert not shares.may_take("flood", 4, 16)  # steady released just now: still active
    clock.now += 0.99
    assert not shares.may_take("flood", 4, 16)
    clock.now += 0.02
    assert shares.may_take("flood", 4, 16)
    assert "steady" not in shares.held


def test_a_refused_tenant_counts_as_heavy_for_a_window() -> None:
    shares, clock = make(0.5)
    hold(shares, "flood", 2)  # holds little, but its requests are being refused
    shares.refused("flood")
    hold(shares, "steady", 2)
    assert not shares.may_take("flood", 4, 16)
    clock.now += 1.5
    assert shares.may_take("flood", 4, 16)  # the refusal is forgotten: light again


def test_weights_set_the_share_that_makes_a_tenant_heavy() -> None:
    # 16 slots, weights 3 : 1 -> shares 12 and 4.
    shares, _ = make(0.5, queued={}, weights={"big": 3.0})
    hold(shares, "big", 6)
    hold(shares, "small", 4)
    assert not shares.may_take("small", 6, 16)  # demand 4 reaches its share of 4
    assert shares.may_take("big", 6, 16)  # demand 6 is below its share of 12


def test_headroom_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="headroom must be in"):
        TenantHeadroom(1.0)
    with pytest.raises(ValueError, match="headroom must be in"):
        TenantHeadroom(-0.1)
