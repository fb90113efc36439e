"""A stream's request is billed as its caller got it: the edge's usage record says OK
exactly when the request's whole answer was written to the caller.

The child below the edge plays a region caught by a fault, over real gRPC on loopback:
one that answers in full and then hangs (SIGSTOP between its final response and its
status) or loses its connection (keepalive closing it), and a fast child whose answer the
caller never reads. The chaos bench's ``sigstop-regional`` met the first two as usage
records lost (served, not billed OK) and the last as phantom ones (billed, not served).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.config.access import AuthConfig, TenantConfig
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2Server
from common.request.v2 import FINAL_RESPONSE, generate_request, response_text, text_response
from common.tenancy.auth import hash_key
from common.tenancy.usage import UsageRecord
from common.tier.server import TierServer
from tests.common.request.test_forwarding_loop import MODEL
from tests.common.tenancy.test_admission import records_with
from tests.common.tier.edge import edge_tier

# A caller that reads nothing: without BDP probing its window stays at 64 KiB, so the
# edge's writes of a large answer block (``tests/local_lb/test_stream_slots.py``).
UNREAD_OPTIONS = [("grpc.http2.bdp_probe", 0)]
BIG_TEXT = "x" * 40_000
ACME = TenantConfig(id="acme", key_hashes=frozenset({hash_key("mk_acme")}))


class FaultyRegion(pb_grpc.GRPCInferenceServiceServicer):
    """Answers each streamed request with ``texts`` (the last marked final unless
    ``final`` is False), then ``after``: hang until cancelled, fail UNAVAILABLE, or end OK."""

    def __init__(self, texts: list[str], after: str, *, final: bool = True) -> None:
        self.texts = texts
        self.after = after
        self.final = final
        self.answered = 0  # answers written to their end

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        async for request in requests:
            for i, text in enumerate(self.texts):
                final = self.final and i == len(self.texts) - 1
                response = text_response(request, text, final=final)
                await context.write(pb.ModelStreamInferResponse(infer_response=response))
            self.answered += 1
        if self.after == "hang":  # stopped before its status went out
            await asyncio.Event().wait()
        if self.after == "fail":  # its connection closed by keepalive
            await context.abort(grpc.StatusCode.UNAVAILABLE, "keepalive watchdog timeout")


Edge = Callable[[FaultyRegion], Awaitable[TierServer]]


@pytest.fixture
async def edge_over(redis_server: EmbeddedRedis) -> AsyncIterator[Edge]:
    """``edge_over(child)``: the edge (tenant acme) over ``child`` as its one region;
    the fixture stops every server it started."""
    started: list[V2Server | TierServer] = []

    async def make(child: FaultyRegion) -> TierServer:
        region = V2Server(child, Endpoint("127.0.0.1", 0))
        await region.start()
        started.append(region)
        tier = edge_tier(region, AuthConfig(enabled=True, tenants=(ACME,)), redis_server.url)
        await tier.start()
        started.append(tier)
        return tier

    try:
        yield make
    finally:
        for server in reversed(started):
            await server.stop(0)


async def one_request_stream(
    address: str, texts_read: list[str], *, timeout: float, read: bool = True
) -> tuple[str, grpc.StatusCode]:
    """One streamed request as the chaos bench's callers send it: its trace id and the
    stream's status; the responses read go into ``texts_read`` (final ones as ``FINAL``)."""
    trace_id = secrets.token_hex(16)
    metadata = [
        ("authorization", "Bearer mk_acme"),
        ("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-00"),
    ]
    options = [] if read else UNREAD_OPTIONS
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = generate_request(MODEL, "one two three", 16, request_id="r", stream=True)
        call = stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=timeout)
        if not read:
            await asyncio.sleep(timeout + 0.3)
        try:
            async for response in call:
                params = response.infer_response.parameters
                final = FINAL_RESPONSE in params and params[FINAL_RESPONSE].bool_param
                texts_read.append(response.error_message or ("FINAL" if final else "token"))
            return trace_id, grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return trace_id, exc.code()


async def record_of(tier: TierServer, redis_server: EmbeddedRedis, trace_id: str) -> UsageRecord:
    await tier.stop(0)  # flushes the usage records
    [record] = records_with(redis_server, trace_id)
    return record


async def test_an_answer_whose_region_hangs_before_its_status_is_billed_ok(
    edge_over: Edge, redis_server: EmbeddedRedis
) -> None:
    """The caller got the final response; the region never sent its status, so the
    call runs into the caller's deadline: served, and billed OK."""
    tier = await edge_over(FaultyRegion(["a", "b"], after="hang"))
    read: list[str] = []
    trace_id, code = await one_request_stream(f"127.0.0.1:{tier.port}", read, timeout=1.0)
    assert read == ["token", "FINAL"]
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    record = await record_of(tier, redis_server, trace_id)
    assert (record.status, record.tenant, record.completion_tokens) == ("OK", "acme", 2)
    assert record.region == "us-east"  # the route as far as the edge knows it


async def test_an_answer_whose_region_fails_after_it_is_billed_ok_and_not_followed_by_an_error(
    edge_over: Edge, redis_server: EmbeddedRedis
) -> None:
    tier = await edge_over(FaultyRegion(["a", "b"], after="fail"))
    read: list[str] = []
    trace_id, code = await one_request_stream(f"127.0.0.1:{tier.port}", read, timeout=5.0)
    assert (read, code) == (["token", "FINAL"], grpc.StatusCode.OK)
    record = await record_of(tier, redis_server, trace_id)
    assert (record.status, record.completion_tokens) == ("OK", 2)
    assert record.region == "us-east"


async def test_a_partial_answer_cut_by_its_region_stays_a_failure(
    edge_over: Edge, redis_server: EmbeddedRedis
) -> None:
    """No final response came: the caller got a token and an error, and so does the bill."""
    tier = await edge_over(FaultyRegion(["a"], after="fail", final=False))
    read: list[str] = []
    trace_id, code = await one_request_stream(f"127.0.0.1:{tier.port}", read, timeout=5.0)
    assert code == grpc.StatusCode.OK  # the stream goes on; the request failed in it
    assert read[0] == "token" and read[1].startswith("UNAVAILABLE")
    record = await record_of(tier, redis_server, trace_id)
    assert record.status == "UNAVAILABLE"


async def test_an_answer_the_caller_never_got_is_not_billed_ok(
    edge_over: Edge, redis_server: EmbeddedRedis
) -> None:
    """The region answers in full at once, but the caller reads nothing: the edge's
    writes block, the final response is still waiting when the deadline ends the call."""
    tier = await edge_over(FaultyRegion([BIG_TEXT] * 4, after="ok"))
    read: list[str] = []
    trace_id, code = await one_request_stream(
        f"127.0.0.1:{tier.port}", read, timeout=1.0, read=False
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "FINAL" not in read
    record = await record_of(tier, redis_server, trace_id)
    assert record.status == "DEADLINE_EXCEEDED"


async def test_a_caller_that_reads_late_frees_its_region_and_is_billed_ok_for_the_whole(
    edge_over: Edge, redis_server: EmbeddedRedis
) -> None:
    """The caller reads nothing until its region has answered in full (4000 responses, more
    than a 64 KiB window and the 256 an edge holds unmerged take): the edge keeps reading the
    region, so the region's call ends and its lease goes back before the caller reads; read
    then, every response's text arrives once, in order, and the request is billed OK."""
    texts = [f"{i:04}" + "y" * 16 for i in range(4000)]
    region = FaultyRegion(texts, after="ok")
    tier = await edge_over(region)
    trace_id = secrets.token_hex(16)
    metadata = [
        ("authorization", "Bearer mk_acme"),
        ("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-00"),
    ]
    address = f"127.0.0.1:{tier.port}"
    async with grpc.aio.insecure_channel(address, options=UNREAD_OPTIONS) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = generate_request(MODEL, "one two three", 4000, request_id="r", stream=True)
        call = stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=20)
        for _ in range(300):  # the region's answer relayed to its end, nothing read yet
            if region.answered and [c.outstanding_requests for c in tier.children] == [0]:
                break
            await asyncio.sleep(0.01)
        assert region.answered == 1
        assert [child.outstanding_requests for child in tier.children] == [0]
        assert not call.done()
        read = [r async for r in call]
        assert await call.code() == grpc.StatusCode.OK
    assert "".join(response_text(r.infer_response) for r in read) == "".join(texts)
    assert read[-1].infer_response.parameters[FINAL_RESPONSE].bool_param
    record = await record_of(tier, redis_server, trace_id)
    assert (record.status, record.completion_tokens) == ("OK", 4000)
