"""Two regions, each with its own Redis, under one global Redis (``regions[].redis_url``).

In-process over real gRPC and three real Redis servers: each region's zone
streams are on that region's Redis and nowhere else; the region streams, the
tenant's concurrency lease and the usage records are on the global Redis and on no
region's; the global tier routes to both regions on those summaries, and still
does once one region's Redis is gone.
Checked with real XLEN and SCAN on all three.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis

from cli.launcher import Fleet
from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import region_stream, zone_stream
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE
from common.tenancy.usage import USAGE_STREAM
from common.tier.server import TierServer
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.worker import ZoneWorkers
from tests.conftest import small_fleet_spec
from tests.e2e.test_fleet_quotas import (
    KEY,
    REGIONS,
    generate,
    two_region_mapping,
    until_both_regions_ready,
)


@dataclass
class Redises:
    """The global Redis and one per region, each its own process."""

    global_: EmbeddedRedis
    regions: dict[str, EmbeddedRedis]

    def client(self, where: str) -> redis.Redis:
        server = self.global_ if where == "global" else self.regions[where]
        return redis.Redis(port=server.port, socket_timeout=2.0)


@pytest.fixture
def redises() -> Iterator[Redises]:
    servers = Redises(EmbeddedRedis(), {region: EmbeddedRedis() for region in REGIONS})
    every = [servers.global_, *servers.regions.values()]
    try:
        for server in every:
            server.start()
        yield servers
    finally:
        for server in every:
            server.close()


def regional_topology(redises: Redises) -> Topology:
    mapping = two_region_mapping(redises.global_.url)
    for region in mapping["regions"]:
        region["redis_url"] = redises.regions[region["name"]].url
    mapping["auth"]["tenants"][0]["requests_per_s"] = 1000
    return topology_from_mapping(mapping)


@pytest.fixture
async def edge(
    redises: Redises, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    topo = regional_topology(redises)
    zones = [
        ZoneWorkers(topo.zone(region, zone), region=region, time_scale=0.05)
        for region, (zone, _) in REGIONS.items()
    ]
    tiers: list[TierServer] = [
        *(build_local_tier(topo, region, zone) for region, (zone, _) in REGIONS.items()),
        *(build_regional_tier(topo, region) for region in REGIONS),
        build_global_tier(topo),
    ]
    started: list[TierServer] = []
    try:
        for workers in zones:
            await workers.start()
        for tier in tiers:
            await tier.start()
            started.append(tier)
        async with grpc.aio.insecure_channel(topo.global_tier.endpoint.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            await until_both_regions_ready([stub])
            yield stub
    finally:
        for tier in reversed(started):
            await tier.stop(0)
        for workers in zones:
            await workers.stop(0)


def keys(client: redis.Redis, pattern: str) -> set[str]:
    return {k.decode() for k in client.scan_iter(match=pattern, count=1000)}


async def test_each_region_keeps_its_zone_streams_on_its_own_redis(
    redises: Redises, edge: pb_grpc.GRPCInferenceServiceStub
) -> None:
    for region in REGIONS:  # the global tier still routes to each region
        metadata = [("authorization", f"Bearer {KEY}"), ("x-meridian-client-region", region)]
        call = edge.ModelInfer(generate(f"to {region}", 2), metadata=metadata, timeout=10)
        await call
        assert (dict(await call.trailing_metadata()).get(ROUTE) or "").startswith(region)

    glob = redises.client("global")
    try:
        for region, (zone, _) in REGIONS.items():
            own = redises.client(region)
            try:
                assert own.xlen(zone_stream(region, zone)) > 0
                assert keys(own, "meridian:capacity:*") == {zone_stream(region, zone)}
                assert keys(own, "meridian:quota:*") | keys(own, "meridian:concurrency:*") == set()
                assert not own.exists(USAGE_STREAM)
            finally:
                own.close()
            assert glob.xlen(region_stream(region)) > 0
        assert keys(glob, "meridian:capacity:*") == {region_stream(r) for r in REGIONS}
        assert keys(glob, "meridian:capacity:zone:*") == set()
        for _ in range(100):  # the edge writes usage in batches, every 0.1 s
            if glob.xlen(USAGE_STREAM) >= len(REGIONS):
                break
            await asyncio.sleep(0.05)
        assert glob.xlen(USAGE_STREAM) >= len(REGIONS)
        # A call in flight holds its tenant's concurrency lease, on the global Redis.
        metadata = [("authorization", f"Bearer {KEY}")]
        call = edge.ModelInfer(generate("a long one", 800), metadata=metadata, timeout=20)
        lease = "meridian:concurrency:{narrow}:leases"
        for _ in range(200):
            if glob.exists(lease) or call.done():
                break
            await asyncio.sleep(0.01)
        assert glob.zcard(lease) == 1
        await call

        # A region's Redis lost: its summaries go stale, and both regions still serve.
        redises.regions["eu"].stop()
        await asyncio.sleep(2.0)  # past the summary TTL (3 × 0.5 s)
        for region in (*REGIONS, *REGIONS):
            metadata = [("authorization", f"Bearer {KEY}"), ("x-meridian-client-region", region)]
            call = edge.ModelInfer(generate(f"to {region}", 2), metadata=metadata, timeout=10)
            await call
            assert (dict(await call.trailing_metadata()).get(ROUTE) or "").startswith(region)
    finally:
        glob.close()


def test_meridian_up_starts_a_redis_of_its_own_for_a_region_that_asks(
    fleet_factory: Callable[..., Fleet],
) -> None:
    """``redis_url: embedded`` on a region of the fleet file (cli.region_redis): the
    launcher starts a second Redis, the region's zone streams go there, the others'
    and the region streams stay on the fleet's Redis."""
    spec = small_fleet_spec(regions=2, zones=1, gpus=1)
    own, other = spec["regions"][0], spec["regions"][1]
    own["redis_url"] = "embedded"
    fleet = fleet_factory(spec)
    assert set(fleet.region_redis) == {own["name"]} and fleet.redis is not None
    assert fleet.topology.region(own["name"]).redis_url == fleet.region_redis[own["name"]].url
    own_zone, other_zone = own["zones"][0]["name"], other["zones"][0]["name"]
    regional = redis.Redis(port=fleet.region_redis[own["name"]].port, socket_timeout=2.0)
    glob = redis.Redis(port=fleet.redis.port, socket_timeout=2.0)
    try:
        deadline = time.monotonic() + 10
        while not regional.exists(zone_stream(own["name"], own_zone)):
            assert time.monotonic() < deadline, "no zone summary on the region's own Redis"
            time.sleep(0.1)
        assert keys(regional, "meridian:capacity:*") == {zone_stream(own["name"], own_zone)}
        assert not glob.exists(zone_stream(own["name"], own_zone))
        assert glob.exists(zone_stream(other["name"], other_zone))
        assert glob.exists(region_stream(own["name"]), region_stream(other["name"])) == 2
    finally:
        regional.close()
        glob.close()
