"""Reserved headroom: who may take the zone's last free slots (local_lb.tenancy)."""

from __future__ import annotations

import math

import pytest

from local_lb.tenancy import TenantHeadroom

# The zone finishes 1600 work tokens per second: two equal tenants' shares are 800 each.
CAPACITY = 1600.0


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def make(
    headroom: float = 0.5, weights: dict[str, float] | None = None
) -> tuple[TenantHeadroom, Clock]:
    clock = Clock()
    w = weights or {}
    shares = TenantHeadroom(headroom, window_s=2.0, weight=lambda t: w.get(t, 1.0), clock=clock)
    return shares, clock


def send(shares: TenantHeadroom, clock: Clock, seconds: float, **rates: float) -> None:
    """Each tenant sends its rate in work tokens per second, in 10 ms steps, for ``seconds``."""
    for _ in range(round(seconds * 100)):
        for tenant, rate in rates.items():
            shares.arrived(tenant, rate / 100)
        clock.now += 0.01


def hold(shares: TenantHeadroom, tenant: str, n: int) -> None:
    for _ in range(n):
        shares.took(tenant)


def test_offered_rate_tracks_what_a_tenant_sends() -> None:
    shares, clock = make()
    send(shares, clock, 10.0, a=300.0)
    assert shares.offered_rate("a") == pytest.approx(300.0, rel=0.05)
    clock.now += 2.0  # one time constant of silence
    assert shares.offered_rate("a") == pytest.approx(300.0 / math.e, rel=0.05)
    assert shares.offered_rate("never") == 0.0


def test_anyone_takes_a_slot_above_the_headroom() -> None:
    shares, clock = make(0.5)
    send(shares, clock, 3.0, flood=5000.0)
    send(shares, clock, 1.0, steady=100.0)
    # 16 usable: 9 free leaves 8, the reserve; 8 free would leave 7.
    assert shares.may_take("flood", 9, 16, CAPACITY)
    assert not shares.may_take("flood", 8, 16, CAPACITY)


def test_heavy_tenant_kept_out_of_the_headroom_while_a_light_one_is_active() -> None:
    shares, clock = make(0.5)
    send(shares, clock, 3.0, flood=5000.0, steady=600.0)  # below its share of 800
    assert not shares.may_take("flood", 8, 16, CAPACITY)
    assert shares.may_take("steady", 8, 16, CAPACITY)
    assert shares.may_take("steady", 1, 16, CAPACITY)  # down to the very last slot


def test_a_light_tenant_holding_many_slots_stays_light() -> None:
    # Its requests got slow (a stall): it holds more slots, but sends no more.
    shares, clock = make(0.5)
    send(shares, clock, 3.0, flood=5000.0, steady=600.0)
    hold(shares, "steady", 12)
    assert not shares.may_take("flood", 4, 16, CAPACITY)
    assert shares.may_take("steady", 4, 16, CAPACITY)


def test_work_conserving_when_every_active_tenant_is_heavy() -> None:
    shares, clock = make(0.5)
    send(shares, clock, 3.0, a=2000.0, b=2000.0)
    assert shares.may_take("a", 8, 16, CAPACITY)
    assert shares.may_take("b", 1, 16, CAPACITY)


def test_a_lone_tenant_may_fill_the_zone() -> None:
    shares, clock = make(0.5)
    send(shares, clock, 3.0, flood=5000.0)
    assert shares.may_take("flood", 1, 16, CAPACITY)


def test_protection_ends_a_window_after_the_light_tenant_went_quiet() -> None:
    shares, clock = make(0.5)
    send(shares, clock, 1.0, steady=100.0, flood=5000.0)
    send(shares, clock, 1.0, flood=5000.0)  # steady is quiet from here on
    assert not shares.may_take("flood", 4, 16, CAPACITY)  # heard from 1 s ago: active
    clock.now += 1.0
    assert shares.may_take("flood", 4, 16, CAPACITY)
    hold(shares, "steady", 1)  # but a tenant holding a slot is active however quiet
    clock.now += 2 * shares.reclassify_s
    assert not shares.may_take("flood", 4, 16, CAPACITY)


def test_unknown_capacity_makes_nobody_heavy() -> None:
    shares, clock = make(0.5)
    send(shares, clock, 1.0, flood=5000.0, steady=100.0)
    assert shares.may_take("flood", 1, 16, math.inf)


def test_weights_set_the_share_that_makes_a_tenant_heavy() -> None:
    # Weights 3 : 1 of 1600 tokens/s: shares 1200 and 400.
    shares, clock = make(0.5, weights={"big": 3.0})
    send(shares, clock, 10.0, big=1000.0, small=500.0)
    assert not shares.may_take("small", 6, 16, CAPACITY)  # 500 is over its 400
    assert shares.may_take("big", 6, 16, CAPACITY)  # 1000 is under its 1200


def test_headroom_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="headroom must be in"):
        TenantHeadroom(1.0)
    with pytest.raises(ValueError, match="headroom must be in"):
        TenantHeadroom(-0.1)


def test_no_headroom_lets_everyone_in() -> None:
    shares, clock = make(0.0)
    send(shares, clock, 3.0, flood=5000.0, steady=100.0)
    assert shares.may_take("flood", 1, 16, CAPACITY)


def test_a_heavy_tenant_gets_a_slot_of_an_idle_small_zone() -> None:
    # 2 slots, headroom 0.6: the reserve is capped at all but one slot.
    shares, clock = make(0.6)
    send(shares, clock, 3.0, flood=5000.0, steady=100.0)
    assert shares.may_take("flood", 2, 2, CAPACITY)
    assert not shares.may_take("flood", 1, 2, CAPACITY)
    assert shares.may_take("steady", 1, 2, CAPACITY)


def test_classification_is_reused_for_a_while() -> None:
    shares, clock = make(0.5)
    send(shares, clock, 3.0, flood=5000.0, steady=100.0)
    assert not shares.may_take("flood", 4, 16, CAPACITY)
    send(shares, clock, 0.03, steady=0.0)  # 30 ms later: the same answer without a rescan
    shares._arrivals.clear()  # would make everyone inactive, were it looked at
    assert not shares.may_take("flood", 4, 16, CAPACITY)
    clock.now += 2 * shares.reclassify_s
    assert shares.may_take("flood", 4, 16, CAPACITY)
