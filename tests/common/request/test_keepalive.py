"""Keepalive against real gRPC servers on loopback: Meridian's servers take the fastest
pings a topology may configure, where a stock gRPC server (Triton's defaults) sends
GOAWAY too_many_pings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.config.liveness import MIN_KEEPALIVE_TIME_S, Keepalive
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2Server, channel_options

FASTEST = Keepalive(time_s=MIN_KEEPALIVE_TIME_S, timeout_s=1.0, without_calls=True)
READY = grpc.ChannelConnectivity.READY


async def check(channel: grpc.aio.Channel) -> None:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=2
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def idle_state(address: str, keepalive: Keepalive, idle_s: float) -> grpc.ChannelConnectivity:
    """The channel's state after a call and ``idle_s`` with no call open."""
    async with grpc.aio.insecure_channel(address, options=channel_options(keepalive)) as channel:
        await check(channel)
        await asyncio.sleep(idle_s)
        return channel.get_state(try_to_connect=False)


@pytest.fixture
async def meridian_server() -> AsyncIterator[str]:
    server = V2Server(pb_grpc.GRPCInferenceServiceServicer(), Endpoint("127.0.0.1", 0))
    await server.start()
    await server.set_serving(True)
    try:
        yield server.address
    finally:
        await server.stop(0)


@pytest.fixture
async def stock_server() -> AsyncIterator[str]:
    """A gRPC server left at gRPC's defaults, as Triton leaves its own."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_fast_pings_keep_a_meridian_servers_connection_where_a_stock_one_goaways(
    meridian_server: str, stock_server: str
) -> None:
    # Pings every second for 4.5 s with no call open: a stock server (Triton's
    # defaults) closes the connection with GOAWAY too_many_pings at the third ping it
    # takes for abuse; Meridian's servers accept them.
    ours, stock = await asyncio.gather(
        idle_state(meridian_server, FASTEST, 4.5), idle_state(stock_server, FASTEST, 4.5)
    )
    assert ours == READY
    assert stock != READY
