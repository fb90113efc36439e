"""``max_concurrent`` across the whole fleet: two global replicas over two regions.

In-process over real gRPC: two global tiers (replicas sharing the session Redis),
a regional and a local tier per region, emulated GPUs. A tenant capped at 2 fires
6 long calls at once through both replicas: never more than 2 run anywhere, the
other 4 get RESOURCE_EXHAUSTED with ``retry-after-ms`` and ``x-meridian-quota``,
and none of them reaches a GPU (no region was asked to run it, so none failed over).
Before, each regional and local tier counted the cap for itself and a regional
refusal was failed over to the other region: 4 ran at once.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from common.basics.errors import RETRY_AFTER_MS, TENANT_QUOTA
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE
from common.request.v2 import generate_request
from common.tenancy.auth import hash_key
from common.tier.server import TierServer
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers

MODEL, KEY, CAP = "m", "mk_narrow-test-key", 2
REGIONS = {"eu": ("eu-1a", (50.0, 5.0)), "us": ("us-1a", (40.0, -75.0))}
NEAR_EU = ("x-meridian-client-geo", "51.5,-0.1")


def two_region_mapping(redis_url: str) -> dict[str, Any]:
    mapping = one_zone_mapping(
        redis_url,
        gpus=1,
        model=MODEL,
        max_concurrency=8,  # room for every call: only the tenant's cap may refuse
        region="eu",
        zone="eu-1a",
        global_listen=f"127.0.0.1:{free_port()}",
        region_listen=f"127.0.0.1:{free_port()}",
        global_location=(50.0, 0.0),
        region_location=REGIONS["eu"][1],
        health_interval_s=0.2,
        slow_start_window_s=0,
        failback_window_s=0,
    )
    us = copy.deepcopy(mapping["regions"][0])
    us.update(name="us", listen=f"127.0.0.1:{free_port()}")
    us["location"] = {"lat": REGIONS["us"][1][0], "lon": REGIONS["us"][1][1]}
    [zone] = us["zones"]
    zone.update(name="us-1a", listen=f"127.0.0.1:{free_port()}")
    for gpu in zone["gpus"]:
        gpu.update(
            name=f"us-{gpu['name']}",
            listen=f"127.0.0.1:{free_port()}",
            metrics_listen=f"127.0.0.1:{free_port()}",
        )
    mapping["regions"].append(us)
    mapping["auth"] = {
        "enabled": True,
        "tenants": [{"id": "narrow", "api_key_sha256": [hash_key(KEY)], "max_concurrent": CAP}],
    }
    return mapping


@dataclass
class Fleet:
    edges: list[pb_grpc.GRPCInferenceServiceStub]
    zones: list[ZoneWorkers]

    def in_flight(self) -> int:
        return sum(w.engine.running + w.engine.waiting for zone in self.zones for w in zone)

    def served(self) -> int:
        return sum(w.engine.stats().requests_total for zone in self.zones for w in zone)


@pytest.fixture
async def fleet(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Fleet]:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    mapping = two_region_mapping(redis_server.url)
    second = copy.deepcopy(mapping)
    second["global"]["listen"] = f"127.0.0.1:{free_port()}"
    topo, topo_b = topology_from_mapping(mapping), topology_from_mapping(second)
    zones = [
        ZoneWorkers(topo.zone(region, zone), region=region, time_scale=0.05)
        for region, (zone, _) in REGIONS.items()
    ]
    tiers: list[TierServer] = [
        *(build_local_tier(topo, region, zone) for region, (zone, _) in REGIONS.items()),
        *(build_regional_tier(topo, region) for region in REGIONS),
        build_global_tier(topo),
        build_global_tier(topo_b),
    ]
    started: list[TierServer] = []
    channels: list[grpc.aio.Channel] = []
    try:
        for workers in zones:
            await workers.start()
        for tier in tiers:
            await tier.start()
            started.append(tier)
        stubs = []
        for t in (topo, topo_b):
            channel = grpc.aio.insecure_channel(t.global_tier.endpoint.address)
            channels.append(channel)
            stubs.append(pb_grpc.GRPCInferenceServiceStub(channel))
        await until_both_regions_ready(stubs)
        yield Fleet(stubs, zones)
    finally:
        for channel in channels:
            await channel.close()
        for tier in reversed(started):
            await tier.stop(0)
        for workers in zones:
            await workers.stop(0)


async def until_both_regions_ready(stubs: list[pb_grpc.GRPCInferenceServiceStub]) -> None:
    """Every edge answers, through each region (asked by client region), within 20 s."""
    for stub in stubs:
        for region in REGIONS:
            metadata = [("authorization", f"Bearer {KEY}"), ("x-meridian-client-region", region)]
            for _ in range(200):
                try:
                    call = stub.ModelInfer(generate("ready", 1), metadata=metadata, timeout=5)
                    await call
                    if (dict(await call.trailing_metadata()).get(ROUTE) or "").startswith(region):
                        break
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                await asyncio.sleep(0.1)


def generate(prompt: str, max_tokens: int) -> pb.ModelInferRequest:
    return generate_request(MODEL, prompt, max_tokens=max_tokens)


async def test_max_concurrent_holds_across_edge_replicas_and_regions(fleet: Fleet) -> None:
    baseline = fleet.served()
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        for _ in range(2000):  # bounded: 10 s at 5 ms
            peak = max(peak, fleet.in_flight())
            if done.is_set():
                return
            await asyncio.sleep(0.005)

    async def one(i: int) -> grpc.aio.AioRpcError | None:
        stub = fleet.edges[i % 2]  # both replicas, alternately
        metadata = [("authorization", f"Bearer {KEY}"), NEAR_EU]
        try:
            await stub.ModelInfer(generate(f"long call {i}", 800), metadata=metadata, timeout=30)
        except grpc.aio.AioRpcError as err:
            return err
        return None

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*(one(i) for i in range(3 * CAP)))
    finally:
        done.set()
        await watcher
    refused = [err for err in results if err is not None]
    assert len(results) - len(refused) == CAP, [e.details() for e in refused]
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "max_concurrent" in (err.details() or "")
        trailers = dict(err.trailing_metadata() or ())
        assert int(trailers[RETRY_AFTER_MS]) > 0
        assert trailers[TENANT_QUOTA] == "max_concurrent"
        assert ROUTE not in trailers  # refused at the edge: no region was tried
    assert 1 <= peak <= CAP
    assert fleet.served() - baseline == CAP  # the refused never reached a GPU anywhere

    # Every lease went back: the cap's slots are all free again, through either edge.
    for stub in fleet.edges:
        await both_slots_free_soon(stub)


async def both_slots_free_soon(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    """Two calls at once through ``stub`` are served within a second. A replica gives its
    leases back asynchronously (its lease keeper's next turn): a call through the other
    replica straight after an answer may still find that slot held, and be refused with
    retry-after-ms, as a client would be."""
    metadata = [("authorization", f"Bearer {KEY}"), NEAR_EU]
    refusals: list[str] = []
    for _ in range(20):  # bounded: 20 tries, 50 ms apart
        calls = [stub.ModelInfer(generate("again", 4), metadata=metadata, timeout=10)]
        calls.append(stub.ModelInfer(generate("again", 4), metadata=metadata, timeout=10))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        errors = [a for a in answers if isinstance(a, BaseException)]
        if not errors:
            return
        for err in errors:
            if not isinstance(err, grpc.aio.AioRpcError):
                raise err
            details = err.details() or ""
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "max_concurrent" not in details:
                raise err  # only the cap's own refusal is the lag this waits out
            refusals.append(details)
        await asyncio.sleep(0.05)
    raise AssertionError(f"the cap's slots were still held after 20 tries: {refusals[-2:]}")
