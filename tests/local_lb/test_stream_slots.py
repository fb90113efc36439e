"""Streams at the local tier, in-process over real gRPC with emulated GPUs: each request
of a stream holds a GPU slot of its own, and a caller that stops reading loses its
stream after the write timeout, its slots freed and its GPU requests cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request
from common.tier.server import TierServer
from local_lb.server import build_local_tier
from sim.topology import one_zone_mapping
from sim.worker import GpuWorker, ZoneWorkers

REGION, ZONE = "r", "r-1a"
WRITE_TIMEOUT_S = 0.5
# A client that reads nothing: without BDP probing its window stays at 64 KiB, so the
# tier's writes block after ~1500 token responses instead of after megabytes.
UNREAD_OPTIONS = [("grpc.http2.bdp_probe", 0)]


@dataclass
class Zone:
    workers: ZoneWorkers
    tier: TierServer
    address: str

    @property
    def gpus(self) -> list[GpuWorker]:
        return list(self.workers)

    def outstanding(self) -> list[int]:
        return [child.outstanding_requests for child in self.tier.children]


@pytest.fixture
async def zone(redis_server: EmbeddedRedis) -> AsyncIterator[Zone]:
    """Two GPUs of one slot each; slow enough (time scale 0.1) that a long answer is
    still being generated when the write timeout fires."""
    topo = topology_from_mapping(
        one_zone_mapping(
            redis_server.url,
            gpus=2,
            max_concurrency=1,
            region=REGION,
            zone=ZONE,
            health_interval_s=2.0,
            slow_start_window_s=0,
            limits={"stream_write_timeout_s": WRITE_TIMEOUT_S},
        )
    )
    zone_cfg = topo.zone(REGION, ZONE)
    workers = ZoneWorkers(zone_cfg, region=REGION, time_scale=0.1)
    await workers.start()
    tier = build_local_tier(topo, REGION, ZONE)
    await tier.start()
    try:
        for _ in range(100):  # until the tier has seen both GPUs healthy
            if all(child.healthy for child in tier.children):
                break
            await asyncio.sleep(0.05)
        yield Zone(workers, tier, zone_cfg.endpoint.address)
    finally:
        await tier.stop(0)
        await workers.stop(0)


@contextlib.asynccontextmanager
async def peaks(sample: Callable[[], list[int]]) -> AsyncIterator[list[int]]:
    """The highest value each of ``sample()``'s entries reached while the block ran."""
    high = [0] * len(sample())

    async def watch() -> None:
        while True:
            high[:] = [max(h, v) for h, v in zip(high, sample(), strict=True)]
            await asyncio.sleep(0.002)

    task = asyncio.create_task(watch())
    try:
        yield high
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_each_request_of_a_stream_holds_a_gpu_slot_of_its_own(zone: Zone) -> None:
    """Three requests, two one-slot GPUs: both GPUs serve, neither ever runs two at
    once (the third waits in the central queue), and every request is answered."""
    async with grpc.aio.insecure_channel(zone.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        requests = [generate_request("m", f"prompt {i}", 200, request_id=str(i)) for i in range(3)]
        async with peaks(lambda: [gpu.engine.running for gpu in zone.gpus]) as running:
            call: Any = stub.ModelStreamInfer(iter(requests), timeout=30)
            responses = [r async for r in call]
    assert not [r.error_message for r in responses if r.error_message]
    per_id = {str(i): 0 for i in range(3)}
    for response in responses:  # the GPU's count so far: fewer responses once coalesced
        infer = response.infer_response
        per_id[infer.id] = infer.parameters["completion_tokens"].int64_param
    assert per_id == {str(i): 200 for i in range(3)}
    assert running == [1, 1]
    served = [gpu.engine.stats("m").requests_succeeded_total for gpu in zone.gpus]
    assert sorted(served) == [1, 2]
    assert zone.outstanding() == [0, 0]


async def test_a_caller_that_stops_reading_loses_its_stream_and_frees_its_slots(
    zone: Zone,
) -> None:
    async with grpc.aio.insecure_channel(zone.address, options=UNREAD_OPTIONS) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(timeout=30)
        for i in range(2):
            await call.write(generate_request("m", f"long {i}", 8000, request_id=str(i)))
        for _ in range(200):  # both requests running, one on each GPU
            if zone.outstanding() == [1, 1]:
                break
            await asyncio.sleep(0.01)
        assert zone.outstanding() == [1, 1]
        started = time.monotonic()
        for _ in range(400):  # the write timeout ends the stream and frees both slots
            if zone.outstanding() == [0, 0]:
                break
            await asyncio.sleep(0.01)
        freed_after_s = time.monotonic() - started
        assert zone.outstanding() == [0, 0]
        # The GPUs' requests were cancelled mid-generation, not run to their end.
        for _ in range(100):
            if not any(gpu.engine.running for gpu in zone.gpus):
                break
            await asyncio.sleep(0.01)
        assert [gpu.engine.running for gpu in zone.gpus] == [0, 0]
        assert [gpu.engine.stats("m").requests_succeeded_total for gpu in zone.gpus] == [0, 0]
        # Reading now, the caller gets what was buffered, then the stream's status.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "caller stopped reading" in (caught.value.details() or "")
    assert "limits.stream_write_timeout_s" in (caught.value.details() or "")
    assert freed_after_s < 3.0
