"""The local tier in-process over real gRPC: retries only before the first byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE
from common.request.v2 import generate_request
from common.tier.server import TierServer
from local_lb.server import build_local_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers
from tests.client import streamed_tokens

REGION, ZONE = "r", "r-1a"


def topology(redis_url: str, gpus: int, health_interval_s: float) -> Topology:
    return topology_from_mapping(
        one_zone_mapping(
            redis_url,
            gpus=gpus,
            region=REGION,
            zone=ZONE,
            health_interval_s=health_interval_s,
            slow_start_window_s=0,
        )
    )


@dataclass
class Zone:
    workers: ZoneWorkers
    tier: TierServer
    stub: pb_grpc.GRPCInferenceServiceStub

    def worker(self, name: str):  # type: ignore[no-untyped-def]
        return next(w for w in self.workers if w.gpu.name == name)


@pytest.fixture
async def zone(redis_server: EmbeddedRedis) -> AsyncIterator[Zone]:
    # Health checks every 30 s: the tier learns of a dead GPU only by forwarding to it.
    topo = topology(redis_server.url, gpus=2, health_interval_s=30.0)
    zone_cfg = topo.zone(REGION, ZONE)
    workers = ZoneWorkers(zone_cfg, region=REGION, time_scale=0.05)
    await workers.start()
    tier = build_local_tier(topo, REGION, ZONE)
    await tier.start()
    try:
        async with grpc.aio.insecure_channel(zone_cfg.endpoint.address) as channel:
            yield Zone(workers, tier, pb_grpc.GRPCInferenceServiceStub(channel))
    finally:
        await tier.stop(0)
        await workers.stop(0)


async def test_unary_retried_on_another_gpu_when_the_first_is_gone(zone: Zone) -> None:
    await asyncio.sleep(0.5)  # let the monitor's first (immediate) health check finish
    await zone.worker("g0").stop(0)
    dead = zone.tier.children.by_name["g0"]
    for _ in range(20):  # whichever GPU the picker tries first, every request succeeds
        call = zone.stub.ModelInfer(generate_request("m", "hello", 3), timeout=10)
        await call
        route = dict(await call.trailing_metadata())[ROUTE]
        assert route == f"{ZONE}/g1"
        if not dead.healthy:
            break
    # Only a failed forward can have marked it down (health checks are 30 s apart).
    assert not dead.healthy and "UNAVAILABLE" in dead.last_error


async def test_stream_not_retried_after_the_first_byte(zone: Zone) -> None:
    """The request fails with an error_message naming it; the stream itself goes on."""
    call = zone.stub.ModelStreamInfer(timeout=20)
    await call.write(generate_request("m", "a long answer please", 4000, request_id="long"))
    first = await call.read()
    assert first.infer_response.outputs  # a token reached us: no failover from here on
    serving = [w for w in zone.workers if w.engine.running]
    assert len(serving) == 1
    other = next(w for w in zone.workers if w is not serving[0])
    served_before = other.engine.requests_total
    await serving[0].stop(0)
    while not (response := await call.read()).error_message:
        assert response.infer_response.outputs
    assert response.error_message.startswith("UNAVAILABLE: ")
    assert response.error_message.endswith("(request id 'long')")
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    await asyncio.sleep(0.1)
    assert other.engine.requests_total == served_before  # nothing was replayed there


async def test_stream_fails_over_before_the_first_byte(zone: Zone) -> None:
    await zone.worker("g0").stop(0)
    for _ in range(4):
        call = zone.stub.ModelStreamInfer(timeout=10)
        await call.write(generate_request("m", "stream", 3))
        await call.done_writing()
        responses = [r async for r in call]
        assert streamed_tokens([r.infer_response for r in responses]) == 3
        assert dict(await call.trailing_metadata())[ROUTE] == f"{ZONE}/g1"
