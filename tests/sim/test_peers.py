"""Upper-tier peer pickers and the policy sets the simulator compares."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from common.basics.geo import GeoPoint
from common.config.topology import topology_from_mapping
from common.gen.meridian.v1 import capacity_pb2
from common.request.children import Child
from common.request.pick import PickRequest
from global_lb.picker import RegionPicker
from local_lb.policies import POLICIES
from regional_lb.picker import ZonePicker
from sim.peers import (
    SPILL_THRESHOLD,
    LeastLoadedChildPicker,
    NearestRegionPicker,
    RandomChildPicker,
    RoundRobinChildPicker,
    SpillRegionPicker,
    slot_load,
    spill_utilisation,
)
from sim.policies import GREEDY, POLICY_SETS, policy_set
from tests.conftest import small_fleet_spec
from tests.pickers import MODEL, child, request, with_summary

TTL = 1.5
NEW_YORK = GeoPoint(40.71, -74.01)
DUBLIN = GeoPoint(53.35, -6.26)
TOKYO = GeoPoint(35.68, 139.69)
PARIS = GeoPoint(48.86, 2.35)
SAO_PAULO = GeoPoint(-23.55, -46.63)
HOME = GeoPoint(39.0, -77.5)


def regions() -> list[Child]:
    return [
        child("us", location=NEW_YORK),
        child("eu", location=DUBLIN),
        child("ap", location=TOKYO),
    ]


def names(ranked: list[Child]) -> list[str]:
    return [c.name for c in ranked]


def test_nearest_region_ranks_by_distance_from_the_origin() -> None:
    picker = NearestRegionPicker(HOME, TTL)
    # Paris: Dublin ~780 km, New York ~5800 km, Tokyo ~9700 km.
    assert names(picker.rank(request(PARIS), regions(), 0.0)) == ["eu", "us", "ap"]
    # Sao Paulo: New York ~7700 km, Dublin ~9400 km, Tokyo ~18500 km.
    assert names(picker.rank(request(SAO_PAULO), regions(), 0.0)) == ["us", "eu", "ap"]


def test_nearest_region_prefers_the_measured_matrix() -> None:
    picker = NearestRegionPicker(HOME, TTL, rtt_ms={"fr": {"us": 5.0, "eu": 50.0}})
    ranked = picker.rank(request(PARIS, client_region="fr"), regions(), 0.0)
    assert names(ranked) == ["us", "eu", "ap"]  # ap: no measurement, ~150 ms estimated


def test_nearest_region_skips_down_forbidden_and_empty_regions() -> None:
    us, eu, ap = regions()
    eu.healthy = False
    with_summary(ap, healthy_gpus=0, received_at=0.0)
    picker = NearestRegionPicker(HOME, TTL)
    assert names(picker.rank(request(PARIS), [us, eu, ap], 1.0)) == ["us"]
    # The same empty summary, once stale, proves nothing: ap is routed on direct evidence.
    assert names(picker.rank(request(PARIS), [us, eu, ap], 1.0 + TTL + 0.1)) == ["us", "ap"]
    allowed = request(PARIS, allowed_regions=frozenset({"ap", "eu"}))
    assert names(picker.rank(allowed, regions(), 0.0)) == ["eu", "ap"]


def test_nearest_region_never_spills_on_load() -> None:
    us, eu, ap = regions()
    with_summary(eu, healthy_gpus=4, received_at=0.0, free_slots=0, queued_requests=500)
    eu.outstanding_requests = 900
    picker = NearestRegionPicker(HOME, TTL)
    assert names(picker.rank(request(PARIS), [us, eu, ap], 0.5)) == ["eu", "us", "ap"]


# Paris: eu nearest, then us, then ap. Each region reports 10 slots; utilisation is
# this balancer's own in-flight requests per slot (threshold 0.8: 8 in flight is full).


def spill_regions(us: int = 0, eu: int = 0, ap: int = 0) -> list[Child]:
    found = regions()
    for region, in_flight in zip(found, (us, eu, ap), strict=True):
        with_summary(region, healthy_gpus=4, received_at=0.0, total_slots=10)
        region.outstanding_requests = in_flight
    return found


def spill_rank(
    children: list[Child], req: PickRequest | None = None, now: float = 0.5
) -> list[str]:
    picker = SpillRegionPicker(HOME, TTL)
    return names(picker.rank(req or request(PARIS), children, now))


def test_spill_nearest_under_threshold_wins() -> None:
    assert spill_rank(spill_regions(us=0, eu=7, ap=0)) == ["eu", "us", "ap"]


def test_spill_nearest_at_threshold_spills_to_the_next_nearest() -> None:
    assert spill_rank(spill_regions(us=2, eu=8, ap=0)) == ["us", "ap", "eu"]


def test_spill_skips_every_full_region_to_the_nearest_with_room() -> None:
    assert spill_rank(spill_regions(us=9, eu=8, ap=5)) == ["ap", "eu", "us"]


def test_spill_all_full_ranks_least_utilised_first() -> None:
    assert spill_rank(spill_regions(us=12, eu=20, ap=9)) == ["ap", "us", "eu"]


def test_spill_all_full_and_equal_ranks_by_rtt() -> None:
    assert spill_rank(spill_regions(us=10, eu=10, ap=10)) == ["eu", "us", "ap"]


def test_spill_unknown_capacity_counts_as_one_slot() -> None:
    us, eu, ap = spill_regions(us=2, eu=0, ap=0)
    eu.summary = None  # healthy by direct evidence, capacity unknown
    assert spill_rank([us, eu, ap]) == ["eu", "us", "ap"]  # nothing in flight: room
    eu.outstanding_requests = 1
    assert spill_rank([us, eu, ap]) == ["us", "ap", "eu"]  # one in flight: full


def test_spill_stale_report_reads_as_unknown_not_idle() -> None:
    us, eu, ap = spill_regions(us=2, eu=3, ap=0)
    assert spill_rank([us, eu, ap]) == ["eu", "us", "ap"]  # 3 / 10
    stale = 0.5 + TTL
    for region in (us, ap):
        region.summary_received_at = stale  # us and ap reported again, eu did not
    assert spill_rank([us, eu, ap], now=stale) == ["us", "ap", "eu"]  # eu: 3 / 1


def test_spill_capacity_hint_is_a_report() -> None:
    us, eu, ap = spill_regions(us=0, eu=6, ap=0)
    eu.hint = capacity_pb2.ModelCapacity(model=MODEL, healthy_gpus=2, total_slots=5)
    eu.hint_at = 0.2  # newer than the summary: eu now reports 5 slots, 6 / 5 is full
    assert spill_rank([us, eu, ap]) == ["us", "ap", "eu"]


def test_spill_keeps_data_residency() -> None:
    req = request(PARIS, allowed_regions=frozenset({"eu", "ap"}))
    # eu is full: the overflow goes to ap, farther than us, which the tenant may not use.
    assert spill_rank(spill_regions(us=0, eu=9, ap=2), req) == ["ap", "eu"]


def test_spill_skips_down_drained_and_empty_regions() -> None:
    us, eu, ap = spill_regions()
    eu.healthy = False
    assert spill_rank([us, eu, ap]) == ["us", "ap"]
    us.drained = True
    assert spill_rank([us, eu, ap]) == ["ap"]
    us, eu, ap = spill_regions()
    with_summary(eu, healthy_gpus=0, received_at=0.0, total_slots=10)
    assert spill_rank([us, eu, ap]) == ["us", "ap"]


def test_spill_threshold_is_a_parameter() -> None:
    picker = SpillRegionPicker(HOME, TTL, threshold=0.5)
    assert names(picker.rank(request(PARIS), spill_regions(eu=5), 0.5)) == ["us", "ap", "eu"]
    assert names(picker.rank(request(PARIS), spill_regions(eu=4), 0.5)) == ["eu", "us", "ap"]
    with pytest.raises(ValueError, match="spill threshold must be positive, got 0"):
        SpillRegionPicker(HOME, TTL, threshold=0)



def test_a_spill_stack_named_with_a_threshold_runs_at_it() -> None:
    topology = topology_from_mapping(small_fleet_spec())
    stack = policy_set("nginx_least_conn_spill@0.5")
    assert stack.name == "nginx_least_conn_spill@0.5" and "spilling past 50%" in stack.summary
    picker = stack.region_picker(topology, random.Random(1))
    assert isinstance(picker, SpillRegionPicker) and picker.threshold == 0.5
    assert stack.local_policy == policy_set("nginx_least_conn_spill").local_policy
    for name, error in (
        ("meridian@0.5", "only a spill stack (<name>_spill) takes @threshold"),
        ("nginx_least_conn_spill@0", "the spill threshold must be in (0, 1], got '0'"),
        ("nginx_least_conn_spill@high", "the spill threshold must be in (0, 1], got 'high'"),
        ("nobody_spill@0.5", "unknown policy 'nobody_spill@0.5'"),
    ):
        with pytest.raises(ValueError, match=re.escape(error)):
            policy_set(name)

def test_spill_prefers_the_measured_matrix() -> None:
    picker = SpillRegionPicker(HOME, TTL, rtt_ms={"fr": {"us": 5.0, "eu": 50.0}})
    req = request(PARIS, client_region="fr")
    assert names(picker.rank(req, spill_regions(), 0.5)) == ["us", "eu", "ap"]
    assert names(picker.rank(req, spill_regions(us=8), 0.5)) == ["eu", "ap", "us"]


def test_spill_utilisation_is_own_in_flight_per_reported_slot() -> None:
    us, eu, _ = spill_regions(us=4, eu=3)
    with_summary(us, healthy_gpus=4, received_at=0.0, total_slots=10, utilisation=1.0)
    us.outstanding_requests = 4
    assert spill_utilisation(us, MODEL, 0.5, TTL) == 0.4  # the reported busy share is not read
    eu.summary = None
    assert spill_utilisation(eu, MODEL, 0.5, TTL) == 3.0


def test_round_robin_rotates_and_skips_children_that_may_not_serve() -> None:
    zones = [child("a"), child("b"), child("c")]
    picker = RoundRobinChildPicker(TTL)
    firsts = [picker.rank(request(), zones, 0.0)[0].name for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    zones[2].healthy = False
    assert names(picker.rank(request(), zones, 0.0)) == ["b", "a"]
    assert names(picker.rank(request(), zones, 0.0)) == ["a", "b"]


def test_round_robin_over_regions_keeps_data_residency() -> None:
    picker = RoundRobinChildPicker(TTL, residency=True)
    req = request(allowed_regions=frozenset({"eu"}))
    assert {picker.rank(req, regions(), 0.0)[0].name for _ in range(5)} == {"eu"}
    # Zones are not regions: the residency list does not apply to them.
    assert len(RoundRobinChildPicker(TTL).rank(req, regions(), 0.0)) == 3


def test_random_orders_uniformly() -> None:
    picker = RandomChildPicker(random.Random(4), TTL)
    firsts = Counter(picker.rank(request(), regions(), 0.0)[0].name for _ in range(6000))
    assert all(abs(n / 6000 - 1 / 3) < 0.025 for n in firsts.values())
    assert sorted(names(picker.rank(request(), regions(), 0.0))) == ["ap", "eu", "us"]


def zones_with_load() -> list[Child]:
    a = with_summary(child("a"), healthy_gpus=4, received_at=0.0, total_slots=32)
    a.outstanding_requests = 8  # 8 / 32 = 0.25
    b = child("b")
    b.outstanding_requests = 3  # no report: 3 / 1
    c = with_summary(child("c"), healthy_gpus=4, received_at=0.0, total_slots=64)
    c.outstanding_requests = 4  # 4 / 64 = 0.0625
    return [a, b, c]


def test_slot_load_divides_by_reported_slots_or_one() -> None:
    a, b, c = zones_with_load()
    assert [slot_load(z, MODEL, 0.5, TTL) for z in (a, b, c)] == [0.25, 3.0, 0.0625]
    assert slot_load(a, MODEL, 0.5 + TTL, TTL) == 8.0  # the report went stale


def test_least_loaded_ranks_by_requests_per_slot() -> None:
    picker = LeastLoadedChildPicker(random.Random(1), TTL)
    assert names(picker.rank(request(), zones_with_load(), 0.5)) == ["c", "a", "b"]


def test_least_loaded_two_choices_never_puts_the_most_loaded_first() -> None:
    picker = LeastLoadedChildPicker(random.Random(2), TTL, p2c=True)
    zones = zones_with_load()
    firsts = Counter(picker.rank(request(), zones, 0.5)[0].name for _ in range(3000))
    assert firsts["b"] == 0
    # c is first whenever it is drawn: two of the three pairs.
    assert abs(firsts["c"] / 3000 - 2 / 3) < 0.03
    assert sorted(names(picker.rank(request(), zones, 0.5))) == ["a", "b", "c"]


TOPOLOGY = topology_from_mapping(small_fleet_spec(regions=2, zones=2, gpus=1))


def test_unknown_policy_names_every_known_one() -> None:
    with pytest.raises(ValueError) as err:
        policy_set("fastest")
    known = ", ".join(POLICY_SETS)
    assert str(err.value) == f"unknown policy 'fastest'; known: {known}"
    assert known.startswith("meridian, greedy_clairvoyant, ")


def test_every_policy_set_names_a_real_local_policy_and_builds_its_pickers() -> None:
    rng = random.Random(0)
    region = TOPOLOGY.regions[0]
    for name, policies in POLICY_SETS.items():
        assert policies.name == name
        assert policies.local_policy in POLICIES, name
        assert policies.summary and "\n" not in policies.summary
        if name == GREEDY:
            continue
        for picker in (
            policies.region_picker(TOPOLOGY, rng),
            policies.zone_picker(TOPOLOGY, region, rng),
        ):
            assert callable(picker.rank), name


def test_meridian_is_the_servers_own_pickers_and_peers_sit_behind_geo_dns() -> None:
    rng = random.Random(0)
    region = TOPOLOGY.regions[0]
    meridian = policy_set("meridian")
    assert isinstance(meridian.region_picker(TOPOLOGY, rng), RegionPicker)
    assert isinstance(meridian.zone_picker(TOPOLOGY, region, rng), ZonePicker)
    assert meridian.local_policy == "default"
    for name in ("geo_least_conn", "nginx_least_conn", "envoy_least_request", "inference_gateway"):
        assert isinstance(policy_set(name).region_picker(TOPOLOGY, rng), NearestRegionPicker)
    envoy_zone = policy_set("envoy_least_request").zone_picker(TOPOLOGY, region, rng)
    assert isinstance(envoy_zone, LeastLoadedChildPicker) and envoy_zone.p2c
    rr = policy_set("round_robin").region_picker(TOPOLOGY, rng)
    assert isinstance(rr, RoundRobinChildPicker) and rr.residency


PEERS = (
    "geo_least_conn",
    "power_of_two",
    "nginx_least_conn",
    "envoy_least_request",
    "sglang_cache_aware",
    "inference_gateway",
)


def test_policy_sets_list_meridian_greedy_then_each_peer_in_both_stacks() -> None:
    pairs = [name for peer in PEERS for name in (peer, f"{peer}_spill")]
    assert list(POLICY_SETS) == ["meridian", GREEDY, "round_robin", "random", *pairs]


def test_every_spill_set_builds_a_spilling_region_picker_and_least_request_zones() -> None:
    rng = random.Random(0)
    region = TOPOLOGY.regions[0]
    for peer in PEERS:
        geo, spill = policy_set(peer), policy_set(f"{peer}_spill")
        assert spill.local_policy == geo.local_policy, peer
        region_picker = spill.region_picker(TOPOLOGY, rng)
        assert isinstance(region_picker, SpillRegionPicker), peer
        assert region_picker.threshold == SPILL_THRESHOLD
        assert region_picker.rtt_ms == TOPOLOGY.rtt_ms
        zone_picker = spill.zone_picker(TOPOLOGY, region, rng)
        assert isinstance(zone_picker, LeastLoadedChildPicker) and not zone_picker.p2c, peer
        assert not zone_picker.residency
        assert geo.summary.startswith("geo-DNS, nearest region, no spill on load; "), peer
        assert spill.summary.startswith("global LB spilling past 80% "), peer


def test_greedy_clairvoyant_has_no_pickers_and_says_what_to_use() -> None:
    with pytest.raises(ValueError, match=r"serve it with sim\.greedy\.GreedyClairvoyant"):
        policy_set(GREEDY).region_picker(TOPOLOGY, random.Random(0))
