"""A tier logs shed load as one summary line, however many requests were refused."""

from __future__ import annotations

import logging

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.config.access import AuthConfig, TenantConfig
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2Server
from common.request.v2 import generate_request
from common.tenancy.auth import hash_key
from tests.common.request.test_forwarding_loop import MODEL, ChildServer
from tests.common.tier.edge import edge_tier

SLOW = TenantConfig(id="slow", key_hashes=frozenset({hash_key("mk_slow")}), requests_per_s=1)


async def test_a_burst_of_sheds_at_the_edge_is_one_warning(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    child = V2Server(ChildServer("us-east"), Endpoint("127.0.0.1", 0))
    await child.start()
    auth = AuthConfig(enabled=True, tenants=(SLOW,))
    tier = edge_tier(child, auth, redis_server.url)
    await tier.start()
    codes: list[grpc.StatusCode] = []
    stopped = False
    try:
        with caplog.at_level(logging.INFO, logger="common.observability.logs"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{tier.port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                metadata = (("authorization", "Bearer mk_slow"),)
                for _ in range(30):
                    try:
                        await stub.ModelInfer(
                            generate_request(MODEL, "hi", 2), metadata=metadata, timeout=10
                        )
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as err:
                        codes.append(err.code())
            assert caplog.records == []  # nothing per request; the window is still open
            stopped = True
            await tier.stop(0)  # stopping writes what the window holds
    finally:
        if not stopped:
            await tier.stop(0)
        await child.stop(0)
    shed = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert shed >= 25, codes
    (line,) = caplog.records
    assert line.getMessage().startswith(f"shed {shed} requests in the last ")
    assert (line.sheds, line.tier, line.tenants) == (shed, "global", {"slow": shed})  # type: ignore[attr-defined]
