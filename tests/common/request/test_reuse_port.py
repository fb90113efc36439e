"""SO_REUSEPORT on a V2Server: off (the default), a second server on a taken port fails
to start; on (``Endpoint.reuse_port``, the workers of one tier), both serve it."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.basics.redis_embed import free_port
from common.config.access import Limits
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2Server, server_options


def test_the_option_is_off_unless_asked_for() -> None:
    assert ("grpc.so_reuseport", 0) in server_options(Limits())
    assert ("grpc.so_reuseport", 1) in server_options(Limits(), reuse_port=True)


def test_reuse_port_is_not_part_of_the_address() -> None:
    shared = Endpoint("127.0.0.1", 5, reuse_port=True)
    assert shared == Endpoint("127.0.0.1", 5) and shared.address == "127.0.0.1:5"


async def test_a_second_server_on_a_taken_port_fails() -> None:
    endpoint = Endpoint("127.0.0.1", free_port())
    first = V2Server(pb_grpc.GRPCInferenceServiceServicer(), endpoint)
    await first.start()
    try:
        second = V2Server(pb_grpc.GRPCInferenceServiceServicer(), endpoint)
        # grpcio raises itself (RuntimeError "Failed to bind"); older ones returned 0.
        with pytest.raises((OSError, RuntimeError), match=r"(?i)bind|address in use"):
            await second.start()
        await second.stop(0)
    finally:
        await first.stop(0)


async def test_two_servers_with_reuse_port_share_it_and_either_answers() -> None:
    endpoint = Endpoint("127.0.0.1", free_port(), reuse_port=True)
    servers = [V2Server(pb_grpc.GRPCInferenceServiceServicer(), endpoint) for _ in range(2)]
    for server in servers:
        await server.start()
    try:
        assert [s.port for s in servers] == [endpoint.port] * 2
        await servers[0].stop(0)  # the other one still serves the port
        async with grpc.aio.insecure_channel(endpoint.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for server in servers:
            await server.stop(0)


def test_replace_keeps_reuse_port() -> None:
    shared = Endpoint("127.0.0.1", 5, reuse_port=True)
    assert dataclasses.replace(shared, port=6).reuse_port
