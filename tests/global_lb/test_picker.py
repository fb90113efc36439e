import random

import pytest

from common.basics.geo import GeoPoint
from global_lb.picker import RegionPicker, availability, spill_shares
from tests.pickers import child, request, with_summary

US = GeoPoint(39.04, -77.49)
EU = GeoPoint(53.35, -6.26)
AP = GeoPoint(1.29, 103.85)
HOME = GeoPoint(40.71, -74.01)
TTL = 1.5


def regions():
    return [
        child("us-east", location=US),
        child("eu-west", location=EU),
        child("ap-southeast", location=AP),
    ]


def names(ranked):
    return [c.name for c in ranked]


def test_client_in_europe_goes_to_eu_west_first() -> None:
    ranked = RegionPicker(HOME, TTL).rank(request(GeoPoint(51.5, -0.1)), regions(), now=10)
    assert names(ranked) == ["eu-west", "us-east", "ap-southeast"]


def test_client_in_singapore_goes_to_ap_southeast_first() -> None:
    ranked = RegionPicker(HOME, TTL).rank(request(GeoPoint(1.35, 103.82)), regions(), now=10)
    assert names(ranked)[0] == "ap-southeast"


def test_no_origin_uses_the_global_tiers_own_location() -> None:
    ranked = RegionPicker(HOME, TTL).rank(request(None), regions(), now=10)
    assert names(ranked)[0] == "us-east"


def test_down_region_is_skipped_for_next_nearest() -> None:
    rs = regions()
    rs[1].healthy = False
    ranked = RegionPicker(HOME, TTL).rank(request(EU), rs, now=10)
    assert names(ranked) == ["us-east", "ap-southeast"]


def test_fresh_summary_without_healthy_gpus_skips_region() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=0, received_at=9.5)
    assert names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))[0] == "us-east"


def test_stale_summary_is_unknown_and_health_evidence_decides() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=0, received_at=1.0)  # 9 s old, TTL 1.5 s
    assert names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))[0] == "eu-west"


def test_region_without_the_model_is_skipped() -> None:
    rs = regions()
    rs[1] = child("eu-west", location=EU, models=("other-model",))
    assert "eu-west" not in names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))


def test_summary_with_unknown_zones_does_not_rule_region_out() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=0, received_at=9.5)
    assert "eu-west" not in names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))
    rs[1].summary.models[0].unknown_children = 1
    assert "eu-west" in names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))


def test_summary_without_the_model_is_unknown_not_zero() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=3, received_at=9.5, model="other")
    assert names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))[0] == "eu-west"


def first_counts(picker: RegionPicker, req, rs, now: float = 100.0, n: int = 4000):  # type: ignore[no-untyped-def]
    counts: dict[str, int] = {}
    for _ in range(n):
        name = picker.rank(req, rs, now)[0].name
        counts[name] = counts.get(name, 0) + 1
    return counts


def seeded() -> RegionPicker:
    return RegionPicker(HOME, TTL, rng=random.Random(3))


def test_region_keeps_all_traffic_while_enough_is_healthy() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=6, total_gpus=8, received_at=99.5)  # 75% x 1.4 >= 1
    assert first_counts(seeded(), request(EU), rs) == {"eu-west": 4000}


def test_partial_failure_sheds_the_excess_to_the_next_region() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=4, total_gpus=8, received_at=99.5)  # 50% x 1.4 = 70%
    counts = first_counts(seeded(), request(EU), rs)
    assert abs(counts["eu-west"] / 4000 - 0.70) < 0.04
    assert abs(counts["us-east"] / 4000 - 0.30) < 0.04


def test_every_region_degraded_is_normalised() -> None:
    rs = regions()
    for r in rs:
        with_summary(r, healthy_gpus=2, total_gpus=8, received_at=99.5)  # 35% each
    counts = first_counts(seeded(), request(EU), rs)
    # Shares 0.35, 0.35, 0.35 normalised by their sum 1.05: a third each.
    for name in ("eu-west", "us-east", "ap-southeast"):
        assert abs(counts[name] / 4000 - 1 / 3) < 0.04


def test_panic_routes_by_score_alone() -> None:
    rs = regions()
    for r in rs:
        with_summary(r, healthy_gpus=1, total_gpus=10, received_at=99.5)  # 14% each, sum < 0.5
    assert first_counts(seeded(), request(EU), rs) == {"eu-west": 4000}


def test_queueing_delay_outweighs_a_short_rtt() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=8, total_gpus=8, received_at=99.5, estimated_wait_s=2.0)
    with_summary(rs[0], healthy_gpus=8, total_gpus=8, received_at=99.5, estimated_wait_s=0.0)
    assert names(seeded().rank(request(EU), rs, 100.0))[0] == "us-east"


def test_measured_rtt_matrix_overrides_distance() -> None:
    picker = RegionPicker(
        HOME, TTL, rtt_ms={"eu-west": {"ap-southeast": 5.0, "eu-west": 30.0}}, rng=random.Random(1)
    )
    req = request(EU, client_region="eu-west")
    assert names(picker.rank(req, regions(), 100.0))[0] == "ap-southeast"


def test_region_back_from_an_outage_ramps_up() -> None:
    rs = regions()
    rs[1].healthy_since = 99.0  # came back 1 s ago; fail-back window 10 s from a 10% floor
    counts = first_counts(seeded(), request(EU), rs)
    assert 0.05 < counts["eu-west"] / 4000 < 0.16


def test_data_residency_is_kept_in_failover() -> None:
    rs = regions()
    allowed = frozenset({"ap-southeast"})
    assert names(seeded().rank(request(EU, allowed_regions=allowed), rs, 100.0)) == ["ap-southeast"]
    rs[2].healthy = False
    assert seeded().rank(request(EU, allowed_regions=allowed), rs, 100.0) == []


def test_spill_shares_follow_envoy_priority_load() -> None:
    assert spill_shares([1.0, 1.0]) == [1.0, 0.0]
    assert spill_shares([0.7, 1.0]) == pytest.approx([0.7, 0.3])
    assert spill_shares([0.28, 0.28]) == pytest.approx([0.5, 0.5])


def test_availability_uses_the_overprovisioning_factor() -> None:
    assert availability(5, 7) == 1.0  # 71.4% healthy x 1.4
    assert availability(1, 2) == pytest.approx(0.7)
    assert availability(1, 2, ramp=0.5) == pytest.approx(0.35)


async def test_residency_error_says_so() -> None:
    from common.basics.errors import RouteError
    from common.request.balancer import RankingBalancer
    from common.request.children import ChildSet

    rs = regions()
    rs[2].healthy = False
    rs[2].last_error = "health: UNAVAILABLE"
    balancer = RankingBalancer(seeded(), ChildSet(rs, probe_interval_s=1, summary_ttl_s=TTL))
    with pytest.raises(RouteError) as err:
        await balancer.acquire(request(EU, allowed_regions=frozenset({"ap-southeast"})), (), None)
    assert "data residency" in err.value.message and "ap-southeast" in err.value.message
    assert "eu-west" not in err.value.message


def test_a_full_region_passes_its_clients_to_the_next_by_score() -> None:
    """No free slot in eu-west's report (less what was sent since): its clients go to the
    next region by score; once a slot is free again, they stay home."""
    rs = regions()
    for r in rs:
        with_summary(r, healthy_gpus=4, received_at=99.5, total_slots=64, free_slots=20)
    eu = rs[1]
    eu.summary.models[0].free_slots = 3  # type: ignore[union-attr]
    eu.outstanding_at_report, eu.outstanding_requests = 10, 13  # three sent since the report
    assert first_counts(seeded(), request(EU), rs) == {"us-east": 4000}
    eu.outstanding_requests = 12
    assert first_counts(seeded(), request(EU), rs) == {"eu-west": 4000}


def test_when_every_region_is_full_clients_stay_nearest() -> None:
    rs = regions()
    for r in rs:
        with_summary(r, healthy_gpus=4, received_at=99.5, total_slots=64, free_slots=0)
    assert first_counts(seeded(), request(EU), rs) == {"eu-west": 4000}


def test_a_region_that_moves_is_scored_from_where_it_is_now() -> None:
    # The picker keeps the RTTs it estimated per client place; a region moved by a
    # reload (a new location) must be estimated again, not read from that memo.
    picker, rs = RegionPicker(HOME, TTL), regions()
    london = request(GeoPoint(51.5, -0.1))
    assert names(picker.rank(london, rs, now=10)) == ["eu-west", "us-east", "ap-southeast"]
    rs[1].location = AP  # eu-west now sits in Singapore
    assert names(picker.rank(london, rs, now=10)) == ["us-east", "eu-west", "ap-southeast"]
    rs[1].location = EU
    assert names(picker.rank(london, rs, now=10))[0] == "eu-west"


def test_a_long_request_sees_the_same_waits_as_a_short_one() -> None:
    """What this tier sent a region since its report grows the region's wait by the
    work those requests carry, whoever asks: a long request is not sent across an
    ocean because short ones were sent to its nearest region."""
    rs = regions()
    for r in rs:
        with_summary(
            r,
            healthy_gpus=8,
            total_gpus=8,
            received_at=99.5,
            total_slots=64,
            free_slots=64,
            token_throughput_capacity=10_000.0,
        )
    eu = rs[1]
    eu.outstanding_requests, eu.outstanding_work = 20, 20 * 30.0  # sent since the report
    short, long = request(EU, tokens=10), request(EU, tokens=40_000)
    assert long.work > 100 * short.work
    picker = seeded()
    assert names(picker.rank(short, rs, 100.0))[0] == "eu-west"
    assert names(picker.rank(long, rs, 100.0))[0] == "eu-west"
