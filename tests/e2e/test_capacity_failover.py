"""Capacity flow under failures: Redis restarts, regions die and come back, under load."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from cli.launcher import Fleet
from common.capacity.streams import region_stream
from common.gen.meridian.v1 import capacity_pb2
from tests.client import LoadLoop, region_of
from tests.conftest import small_fleet_spec
from tests.until import wait_until

DUBLIN = ("x-meridian-client-geo", "53.35,-6.26")


def newest_region_summary(fleet: Fleet, region: str) -> capacity_pb2.CapacitySummary | None:
    client = redis.Redis.from_url(fleet.topology.redis_url, socket_timeout=1)
    try:
        entries = client.xrevrange(region_stream(region), count=1)
    except redis.RedisError:
        return None
    finally:
        client.close()
    return capacity_pb2.CapacitySummary.FromString(entries[0][1][b"summary"]) if entries else None


def test_redis_outage_loses_no_request_and_summaries_resume(
    fleet_factory: Callable[..., Fleet],
) -> None:
    fleet = fleet_factory(small_fleet_spec(regions=2, zones=1, gpus=1))
    assert fleet.redis is not None
    with LoadLoop(fleet.global_address, [DUBLIN]) as load:
        time.sleep(1.0)
        fleet.redis.stop()
        time.sleep(3.0)  # longer than the summary TTL: every summary goes stale
        during = len(load.samples)
        fleet.redis.start()

        def resumed() -> bool:
            # Through the whole hierarchy again: zone summary -> regional -> region stream.
            summary = newest_region_summary(fleet, "eu-west")
            return summary is not None and summary.models[0].healthy_gpus == 1

        wait_until(resumed)
        time.sleep(1.0)
    assert load.failures() == []
    assert len(load.samples) > during > 0  # traffic went on through the outage


def test_region_dies_under_load_and_returns_gradually(
    fleet_factory: Callable[..., Fleet],
) -> None:
    spec: dict[str, Any] = small_fleet_spec(regions=2, zones=1, gpus=2)
    spec["failback_window_s"] = 4.0
    fleet = fleet_factory(spec)
    with LoadLoop(fleet.global_address, [DUBLIN], clients=6) as load:
        time.sleep(1.0)
        assert {region_of(s.route) for s in load.since(0) if s.route} == {"eu-west"}
        killed = time.monotonic()
        fleet.kill("regional-eu-west")
        time.sleep(2.0)
        moved = load.since(killed + 0.05)
        assert moved and all(region_of(s.route) == "us-east" for s in moved)
        fleet.restart("regional-eu-west")
        back = time.monotonic()
        time.sleep(1.0)
        early = load.since(back)
        time.sleep(4.5)
        late = load.since(time.monotonic() - 1.0)
    # Nothing was lost: requests in flight in the dead region had sent no byte back, so
    # they failed over too (outside the retry budget: the region itself was gone).
    assert load.failures() == []
    early_share = sum(region_of(s.route) == "eu-west" for s in early) / len(early)
    late_share = sum(region_of(s.route) == "eu-west" for s in late) / len(late)
    assert early_share < 0.5, early_share  # no thundering herd on return
    assert late_share > 0.9, late_share
