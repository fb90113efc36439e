"""VirtualTokenCounters and TenantWeights: charge by weight, lift on joining, fair turns."""

from __future__ import annotations

import pytest

from local_lb.vtc import TenantWeights, VirtualTokenCounters


def test_a_grant_charges_its_tokens_over_the_tenants_weight() -> None:
    vtc = VirtualTokenCounters(TenantWeights({"a": 2.0}))
    vtc.arrive("a")
    vtc.arrive("a")
    vtc.leave("a", 100.0)
    assert vtc.counters["a"] == 50.0 and vtc.backlog == {"a": 1}


def test_leaving_without_a_grant_charges_nothing() -> None:
    vtc = VirtualTokenCounters(TenantWeights())
    vtc.arrive("a")
    vtc.leave("a")
    assert vtc.counters["a"] == 0.0 and vtc.backlog == {}


def test_a_newly_backlogged_tenant_is_lifted_to_the_backlogged_minimum() -> None:
    vtc = VirtualTokenCounters(TenantWeights())
    vtc.arrive("a")
    vtc.arrive("a")
    vtc.leave("a", 300.0)  # a is still backlogged, at 300
    vtc.arrive("b")
    assert vtc.counters["b"] == 300.0  # idling banked b no credit


def test_with_nobody_backlogged_a_tenant_starts_at_the_last_to_leave() -> None:
    vtc = VirtualTokenCounters(TenantWeights())
    vtc.arrive("a")
    vtc.leave("a", 500.0)
    vtc.arrive("b")
    assert vtc.counters["b"] == 500.0


def test_a_lift_never_lowers_a_counter() -> None:
    vtc = VirtualTokenCounters(TenantWeights())
    vtc.arrive("b")  # b stays backlogged at 0
    vtc.arrive("a")
    vtc.leave("a", 900.0)
    vtc.arrive("a")  # the backlogged minimum is b's 0: a keeps its 900
    assert vtc.counters["a"] == 900.0


def test_turns_until_served_under_equal_weights() -> None:
    vtc = VirtualTokenCounters(TenantWeights())
    for _ in range(10):
        vtc.arrive("flood")
    # A newcomer is served after one turn of the flooding tenant, not after its ten.
    assert vtc.turns_until_served("light") == 1


def test_turns_until_served_counts_the_tenants_own_backlog_by_weight() -> None:
    vtc = VirtualTokenCounters(TenantWeights({"a": 3.0}))
    vtc.arrive("a")
    vtc.arrive("b")
    # a's second entry: 2 of its turns, each letting b take 1/3 of a turn.
    assert vtc.turns_until_served("a") == 2


def test_weights_default_to_one_and_must_be_positive_and_finite() -> None:
    weights = TenantWeights({"a": 2.0})
    assert weights("a") == 2.0 and weights("b") == 1.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="must be positive"):
            weights.set("a", bad)
    with pytest.raises(ValueError):
        TenantWeights({"a": 0.0})
