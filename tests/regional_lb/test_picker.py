import asyncio
import random

import grpc

from common.basics.geo import GeoPoint
from common.capacity.summary import CAPACITY_HINT, encode_hint
from common.gen.meridian.v1 import capacity_pb2
from common.request.balancer import Outcome, RankingBalancer
from common.request.children import ChildSet
from regional_lb.picker import ZonePicker, headroom
from tests.pickers import MODEL, child, request, with_summary

ZONE_A = GeoPoint(39.03, -77.47)
ZONE_B = GeoPoint(38.94, -77.45)
ZONE_C = GeoPoint(38.50, -77.00)
HOME = GeoPoint(39.04, -77.49)
TTL = 1.5
NOW = 100.0


def zones():
    return [
        child("1a", location=ZONE_A),
        child("1b", location=ZONE_B),
        child("1c", location=ZONE_C),
    ]


def names(ranked):
    return [c.name for c in ranked]


def picker() -> ZonePicker:
    return ZonePicker(HOME, TTL, rng=random.Random(7))


def firsts(zs, n: int = 4000) -> dict[str, int]:  # type: ignore[no-untyped-def]
    p = picker()
    counts: dict[str, int] = {}
    for _ in range(n):
        name = p.rank(request(ZONE_A), zs, NOW)[0].name
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_request_zone_first_then_by_proximity() -> None:
    assert names(picker().rank(request(ZONE_A), zones(), NOW)) == ["1a", "1b", "1c"]
    assert names(picker().rank(request(ZONE_C), zones(), NOW))[0] == "1c"


def test_own_zone_keeps_traffic_while_it_has_headroom() -> None:
    zs = zones()
    with_summary(zs[0], 4, NOW, free_slots=5)
    assert firsts(zs) == {"1a": 4000}


def test_a_full_zone_passes_its_requests_to_the_zone_waiting_least() -> None:
    zs = zones()
    with_summary(zs[0], 4, NOW, total_slots=64, free_slots=0)
    with_summary(zs[1], 4, NOW, total_slots=64, free_slots=30, estimated_wait_s=0.2)
    with_summary(zs[2], 4, NOW, total_slots=64, free_slots=10, estimated_wait_s=0.01)
    assert firsts(zs) == {"1c": 4000}


def test_a_busier_zone_loses_to_a_nearby_idle_one() -> None:
    """Zones of a region are a millisecond apart: load, not proximity, decides."""
    zs = zones()
    with_summary(zs[0], 4, NOW, total_slots=64, free_slots=20, estimated_wait_s=0.3)
    with_summary(zs[1], 4, NOW, total_slots=64, free_slots=50, estimated_wait_s=0.05)
    with_summary(zs[2], 4, NOW, total_slots=64, free_slots=50, estimated_wait_s=0.05)
    assert firsts(zs) == {"1b": 4000}


def test_requests_sent_since_the_report_grow_a_zones_wait() -> None:
    """Between reports the zone that kept receiving looks busier, so the next one gets
    its turn instead of every request herding to the one that looked best."""
    zs = zones()[:2]
    for z in zs:
        with_summary(z, 4, NOW, total_slots=64, free_slots=54, estimated_wait_s=0.1)
    zs[0].outstanding_at_report, zs[0].outstanding_requests = 10, 16  # 6 sent since
    assert names(picker().rank(request(ZONE_A), zs, NOW)) == ["1b", "1a"]
    zs[0].outstanding_requests = 10
    assert names(picker().rank(request(ZONE_A), zs, NOW)) == ["1a", "1b"]


def test_work_sent_since_the_report_grows_a_zones_wait_whoever_asks() -> None:
    """With capacities reported, a zone's wait grows by the work this tier sent it since
    its report over that capacity, the same for a short request and a long one: a long
    asker does not see the nearer zone as busier than a short one does."""
    zs = zones()[:2]
    for z in zs:
        with_summary(
            z,
            4,
            NOW,
            total_slots=64,
            free_slots=54,
            estimated_wait_s=0.001,
            token_throughput_capacity=8_000.0,
        )
    short, long = request(ZONE_A, tokens=10), request(ZONE_A, tokens=40_000)
    # Six tiny requests sent since: 0.08 ms more, less than 1b is farther.
    zs[0].outstanding_requests, zs[0].outstanding_work = 6, 6 * 0.1
    assert names(picker().rank(short, zs, NOW)) == ["1a", "1b"]
    assert names(picker().rank(long, zs, NOW)) == ["1a", "1b"]
    # Six of 40 work each: 30 ms more, for every asker.
    zs[0].outstanding_work = 6 * 40.0
    assert names(picker().rank(short, zs, NOW)) == ["1b", "1a"]
    assert names(picker().rank(long, zs, NOW)) == ["1b", "1a"]


def test_no_headroom_anywhere_keeps_proximity_order() -> None:
    zs = zones()
    for z in zs:
        with_summary(z, 4, NOW, free_slots=0, queued_requests=3)
    assert names(picker().rank(request(ZONE_A), zs, NOW)) == ["1a", "1b", "1c"]


def test_requests_sent_since_the_report_use_up_headroom() -> None:
    z = child("1a", location=ZONE_A)
    with_summary(z, 4, NOW, free_slots=3)
    z.outstanding_at_report = 2
    z.outstanding_requests = 4  # two more sent since the report
    assert headroom(z, "demo-llm", NOW, TTL) == 1


def test_queued_requests_count_against_headroom() -> None:
    z = child("1a", location=ZONE_A)
    with_summary(z, 4, NOW, free_slots=3, queued_requests=5)
    assert headroom(z, "demo-llm", NOW, TTL) == 0


def test_other_zone_when_own_zone_is_down() -> None:
    zs = zones()
    zs[0].healthy = False
    assert names(picker().rank(request(ZONE_A), zs, NOW))[0] == "1b"


def test_zone_with_no_healthy_gpu_in_fresh_summary_skipped() -> None:
    zs = zones()
    with_summary(zs[0], healthy_gpus=0, received_at=NOW)
    assert "1a" not in names(picker().rank(request(ZONE_A), zs, NOW))


def test_zone_back_from_an_outage_takes_its_traffic_back_gradually() -> None:
    zs = zones()
    zs[0].healthy_since = NOW - 5.0  # halfway through a 10 s fail-back window
    counts = firsts(zs)
    assert 0.4 < counts["1a"] / 4000 < 0.6


def test_a_report_that_counted_this_tiers_finished_request_keeps_no_one_away() -> None:
    """Each answer of zone 1a brings a report made while the request was there (its
    work in flight, ~0.8 ms); the same report then comes through Redis. The request is
    back by then, so 1a is idle again and the next request from next door stays: every
    one of them goes to 1a (before, the report's wait, rounded to 1 ms in the hint, read
    as load for a whole cadence and sent them to 1b, 10 km away, in turns)."""
    zs = zones()[:2]
    children = ChildSet(zs, probe_interval_s=1, summary_ttl_s=TTL, kind="zone", clock=lambda: NOW)
    balancer = RankingBalancer(picker(), children)
    capacity = 16_000.0
    idle = dict(healthy_gpus=1, total_gpus=1, total_slots=8, free_slots=8)
    pick = request(ZONE_A)

    def report(name: str, sequence: int, **fields: float) -> capacity_pb2.CapacitySummary:
        entry = capacity_pb2.ModelCapacity(
            model=MODEL, token_throughput_capacity=capacity, **{**idle, **fields}
        )
        return capacity_pb2.CapacitySummary(source_id=name, sequence=sequence, models=[entry])

    for zone in zs:
        children.take_summary(zone.name, report(zone.name, 1))
    for sequence in range(2, 8):
        lease = asyncio.run(balancer.acquire(pick, (), None))
        assert lease.child.name == "1a", f"request {sequence - 1} went to {lease.child.name}"
        made_during_it = report("1a", sequence, free_slots=7, estimated_wait_s=pick.work / capacity)
        hint = ((CAPACITY_HINT, encode_hint(made_during_it.models[0])),)
        balancer.release(lease, Outcome(grpc.StatusCode.OK, 0.01, trailers=hint))
        children.take_summary("1a", made_during_it)
    assert zs[0].outstanding_requests == 0
