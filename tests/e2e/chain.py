"""One in-process chain (emulated GPUs, then local → regional → global) started and stopped
the same way by every end-to-end test that builds its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc

from common.basics.redis_embed import free_port
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.tier.server import TierServer
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers


@contextlib.asynccontextmanager
async def running_chain(
    topo: Topology,
    workers: ZoneWorkers,
    tiers: Sequence[TierServer],
    model: str,
    *,
    top: str | None = None,
) -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    """Start ``workers`` and ``tiers`` (bottom first), wait until ``model`` is ready through
    the global tier (or the V2 address ``top``, when the chain ends below it), yield a stub
    on it; stop whatever started, top first, however it ends."""
    await workers.start()
    started: list[TierServer] = []
    try:
        for tier in tiers:
            await tier.start()
            started.append(tier)
        async with grpc.aio.insecure_channel(top or topo.global_tier.endpoint.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(100):  # until every tier has seen its children healthy
                if (await stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=5)).ready:
                    break
                await asyncio.sleep(0.1)
            yield stub
    finally:
        for tier in reversed(started):
            await tier.stop(0)
        await workers.stop(0)


def traced_zone_topology(
    redis_url: str, *, model: str, region: str, zone: str, max_concurrency: int = 16
) -> Topology:
    """One region of one zone whose tiers the tracing tests follow: fresh ports, health
    every 0.2 s, no slow start (so every GPU takes requests at once)."""
    return topology_from_mapping(
        one_zone_mapping(
            redis_url,
            model=model,
            max_concurrency=max_concurrency,
            region=region,
            zone=zone,
            global_listen=f"127.0.0.1:{free_port()}",
            region_listen=f"127.0.0.1:{free_port()}",
            global_location=(50.0, 0.0),
            region_location=(50.0, 5.0),
            health_interval_s=0.2,
            slow_start_window_s=0,
        )
    )
