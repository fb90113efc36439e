"""What one stream may hold, through real gRPC on loopback: requests in flight
(backpressure, nothing lost), an idle timeout, and at the edge calls per connection
and open streams per tenant.

A proxy (regional, or the edge) over one child V2 server that answers each streamed
request after ``hold_s`` (or once its gate opens) and counts the requests it holds at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from common.basics.errors import RETRY_AFTER_MS
from common.config.access import Limits
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import Forwarder, ForwardingPolicy
from common.request.proxy import InferenceProxy, TierSpec
from common.request.server import V2Server
from common.request.v2 import generate_request, response_text, text_response
from tests.common.request.front import InOrder
from tests.common.request.test_forwarding_loop import MODEL


@dataclass
class HoldingChild(pb_grpc.GRPCInferenceServiceServicer):
    """Answers each streamed request once ``gate`` is open and ``hold_s`` has passed."""

    hold_s: float = 0.0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    holding: int = 0
    most_held: int = 0
    seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gate.set()

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        async for request in requests:
            self.seen.append(request.id)
            self.holding += 1
            self.most_held = max(self.most_held, self.holding)
            try:
                await self.gate.wait()
                await asyncio.sleep(self.hold_s)
            finally:
                self.holding -= 1
            response = text_response(request, f"answer {request.id}", final=True)
            await context.write(pb.ModelStreamInferResponse(infer_response=response))


@dataclass
class Front:
    stub: pb_grpc.GRPCInferenceServiceStub
    child: HoldingChild
    proxy: InferenceProxy
    children: ChildSet
    address: str


Make = Callable[..., Awaitable[Front]]


@pytest.fixture
async def front() -> AsyncIterator[Make]:
    """``await front(limits, edge=False)``: a proxy over one HoldingChild; torn down after."""
    stops: list[Callable[[], Awaitable[None]]] = []

    async def make(
        limits: Limits,
        *,
        edge: bool = False,
        servicer: pb_grpc.GRPCInferenceServiceServicer | None = None,
    ) -> Front:
        child = HoldingChild()
        child_server = V2Server(servicer or child, Endpoint("127.0.0.1", 0))
        await child_server.start()
        stops.append(lambda: child_server.stop(0))
        children = ChildSet(
            [Child("c", Endpoint("127.0.0.1", child_server.port), frozenset({MODEL}))],
            probe_interval_s=1,
            summary_ttl_s=1,
            probe=False,
        )
        balancer = RankingBalancer(InOrder(), children)
        spec = TierSpec(tier="t", trust_internal=not edge, resolve_origin=lambda hints: None)
        forwarder = Forwarder(ForwardingPolicy(kind="zone"), balancer)
        proxy = InferenceProxy(spec, children, balancer, forwarder, limits=limits)
        server = V2Server(proxy, Endpoint("127.0.0.1", 0), limits=limits, edge=edge)
        await children.start()
        await server.start()
        channel = grpc.aio.insecure_channel(server.address)

        async def stop() -> None:
            await channel.close()
            await server.stop(0)
            await children.stop()
            assert [c.outstanding_requests for c in children] == [0]  # every lease back

        stops.append(stop)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return Front(stub, child, proxy, children, server.address)

    try:
        yield make
    finally:
        for stop in reversed(stops):
            await stop()


def answers(responses: list[pb.ModelStreamInferResponse]) -> list[str]:
    return [r.error_message or response_text(r.infer_response) for r in responses]


async def test_requests_in_flight_are_capped_by_backpressure_and_none_is_lost(
    front: Make,
) -> None:
    f = await front(Limits(max_stream_requests_in_flight=2))
    f.child.hold_s = 0.1
    call = f.stub.ModelStreamInfer(timeout=10)
    for i in range(6):
        await call.write(generate_request(MODEL, "hi", request_id=str(i), stream=True))
    await call.done_writing()
    responses = [r async for r in call]
    assert await call.code() == grpc.StatusCode.OK
    # Two at a time reached the child: the others waited unread, none was refused.
    assert f.child.most_held == 2
    assert sorted(answers(responses)) == [f"answer {i}" for i in range(6)]
    assert sorted(r.infer_response.id for r in responses) == [str(i) for i in range(6)]


async def test_without_a_cap_below_them_the_requests_of_a_stream_run_at_once(
    front: Make,
) -> None:
    f = await front(Limits())  # default cap: 8
    f.child.gate.clear()
    call = f.stub.ModelStreamInfer(timeout=10)
    for i in range(5):
        await call.write(generate_request(MODEL, "hi", request_id=str(i), stream=True))
    await call.done_writing()
    for _ in range(200):
        if f.child.holding == 5:
            break
        await asyncio.sleep(0.01)
    assert f.child.holding == 5
    f.child.gate.set()
    assert len([r async for r in call]) == 5


async def test_a_stream_with_nothing_in_flight_ends_after_the_idle_timeout(front: Make) -> None:
    f = await front(Limits(stream_idle_timeout_s=0.3))
    call = f.stub.ModelStreamInfer(timeout=10)
    await call.write(generate_request(MODEL, "hi", request_id="1", stream=True))
    assert response_text((await call.read()).infer_response) == "answer 1"
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "limits.stream_idle_timeout_s" in (caught.value.details() or "")
    assert time.monotonic() - started < 2.0


async def test_a_request_in_flight_keeps_a_stream_from_being_idle(front: Make) -> None:
    f = await front(Limits(stream_idle_timeout_s=0.2))
    f.child.hold_s = 0.6  # three idle timeouts long
    call = f.stub.ModelStreamInfer(timeout=10)
    await call.write(generate_request(MODEL, "hi", request_id="1", stream=True))
    assert response_text((await call.read()).infer_response) == "answer 1"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_the_edge_caps_open_streams_per_tenant(front: Make) -> None:
    f = await front(Limits(max_open_streams_per_tenant=2), edge=True)
    f.child.gate.clear()
    held = [f.stub.ModelStreamInfer(timeout=10) for _ in range(2)]
    for i, call in enumerate(held):
        await call.write(generate_request(MODEL, "hi", request_id=str(i), stream=True))
    for _ in range(200):
        if f.child.holding == 2:
            break
        await asyncio.sleep(0.01)
    refused = f.stub.ModelStreamInfer(timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await refused.read()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_open_streams_per_tenant" in (caught.value.details() or "")
    assert dict(caught.value.trailing_metadata() or ())[RETRY_AFTER_MS] == "1000"
    # The streams already open are served to the end.
    f.child.gate.set()
    for i, call in enumerate(held):
        await call.done_writing()
        assert answers([r async for r in call]) == [f"answer {i}"]
        assert await call.code() == grpc.StatusCode.OK
    # Their count went back as they ended: a new stream is admitted.
    assert f.proxy.open_streams is not None and f.proxy.open_streams.count("anonymous") == 0
    again = f.stub.ModelStreamInfer(timeout=10)
    await again.write(generate_request(MODEL, "hi", request_id="again", stream=True))
    await again.done_writing()
    assert answers([r async for r in again]) == ["answer again"]


async def test_a_refused_or_failed_stream_gives_its_count_back(front: Make) -> None:
    f = await front(Limits(max_open_streams_per_tenant=1, stream_idle_timeout_s=0.2), edge=True)
    for _ in range(3):  # each ends by its idle timeout; the next one is admitted
        call = f.stub.ModelStreamInfer(timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f.proxy.open_streams is not None and f.proxy.open_streams.count("anonymous") == 0


async def test_the_edge_queues_calls_over_the_per_connection_cap(front: Make) -> None:
    # Opened at once on a fresh connection, before the client has read the server's
    # SETTINGS: the edge announces no HTTP/2 limit they could meet, and holds the
    # third call itself until one of the first two ends; none is refused.
    f = await front(Limits(max_streams_per_connection=2), edge=True)
    f.child.gate.clear()
    calls = [
        f.stub.ModelStreamInfer(
            iter([generate_request(MODEL, "hi", request_id=str(i), stream=True)]), timeout=10
        )
        for i in range(3)
    ]
    for _ in range(200):
        if f.child.holding == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    assert f.child.holding == 2  # the third call waits at the edge for a free slot
    f.child.gate.set()
    for call in calls:
        assert len([r async for r in call]) == 1
        assert await call.code() == grpc.StatusCode.OK
    assert sorted(f.child.seen) == ["0", "1", "2"]
    assert f.child.most_held == 2


async def ended(call: Any) -> grpc.StatusCode:
    """``call``'s status once its responses are read (grpc gives it only after them)."""
    with contextlib.suppress(grpc.aio.AioRpcError):  # its status, read below
        async for _ in call:
            pass
    code: grpc.StatusCode = await call.code()
    return code


async def test_the_edge_sheds_calls_beyond_its_per_connection_queue(front: Make) -> None:
    limits = Limits(max_streams_per_connection=1, max_queued_calls_per_connection=1)
    f = await front(limits, edge=True)
    f.child.gate.clear()
    calls = [
        f.stub.ModelStreamInfer(
            iter([generate_request(MODEL, "hi", request_id=str(i), stream=True)]), timeout=10
        )
        for i in range(3)
    ]
    codes = [asyncio.ensure_future(ended(call)) for call in calls]
    # One call runs, one waits, the third is shed at once (whichever order they came in).
    done, _ = await asyncio.wait(codes, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    [shed] = [calls[codes.index(c)] for c in done]
    assert await shed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = await shed.details() or ""
    assert "limits.max_queued_calls_per_connection" in details, details
    assert dict(await shed.trailing_metadata() or ())[RETRY_AFTER_MS] == "500"
    for _ in range(200):
        if f.child.holding:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert f.child.holding == 1  # the other waits at the edge
    f.child.gate.set()
    assert sorted([(await c).name for c in codes]) == ["OK", "OK", "RESOURCE_EXHAUSTED"]
    assert len(f.child.seen) == 2 and f.child.most_held == 1


async def test_a_call_that_gives_up_waiting_leaves_no_slot_taken(front: Make) -> None:
    f = await front(Limits(max_streams_per_connection=1), edge=True)
    f.child.gate.clear()
    running = f.stub.ModelStreamInfer(
        iter([generate_request(MODEL, "hi", request_id="running", stream=True)]), timeout=10
    )
    for _ in range(200):
        if f.child.holding:
            break
        await asyncio.sleep(0.01)
    waiting = f.stub.ModelStreamInfer(
        iter([generate_request(MODEL, "hi", request_id="gave up", stream=True)]), timeout=0.3
    )
    assert await ended(waiting) == grpc.StatusCode.DEADLINE_EXCEEDED
    f.child.gate.set()
    assert await ended(running) == grpc.StatusCode.OK
    after = f.stub.ModelStreamInfer(
        iter([generate_request(MODEL, "hi", request_id="after", stream=True)]), timeout=5
    )
    assert await ended(after) == grpc.StatusCode.OK
    assert f.child.seen == ["running", "after"]  # the one that gave up never ran


async def test_inner_tiers_do_not_cap_calls_per_connection(front: Make) -> None:
    f = await front(Limits(max_streams_per_connection=2))
    f.child.gate.clear()
    calls = [
        f.stub.ModelStreamInfer(
            iter([generate_request(MODEL, "hi", request_id=str(i), stream=True)]), timeout=10
        )
        for i in range(3)
    ]
    for _ in range(200):
        if f.child.holding == 3:
            break
        await asyncio.sleep(0.01)
    assert f.child.holding == 3
    f.child.gate.set()
    for call in calls:
        assert len([r async for r in call]) == 1


@dataclass
class ChattyChild(pb_grpc.GRPCInferenceServiceServicer):
    """Streams ``tokens`` responses per request as fast as it may."""

    tokens: int = 400

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        async for request in requests:
            for i in range(self.tokens):
                response = text_response(request, "x" * 64, final=i == self.tokens - 1)
                await context.write(pb.ModelStreamInferResponse(infer_response=response))


async def test_callers_that_hang_up_mid_stream_do_not_mark_the_child_down(front: Make) -> None:
    # Writing to a caller that went away can fail inside grpc.aio (an InternalError, not
    # an RpcError); that is the caller's doing and must not count against the child.
    rig = await front(Limits(), servicer=ChattyChild())
    for _ in range(3):
        calls = []
        for n in range(30):
            call = rig.stub.ModelStreamInfer(timeout=10)
            await call.write(generate_request(MODEL, "hi", request_id=str(n), stream=True))
            calls.append(call)
        for call in calls:
            await call.read()
            call.cancel()
        await asyncio.sleep(0.3)
        assert all(c.healthy for c in rig.children), "a caller's hang-up marked the child down"
    call = rig.stub.ModelStreamInfer(timeout=10)
    await call.write(generate_request(MODEL, "hi", request_id="after", stream=True))
    await call.done_writing()
    assert len([r async for r in call]) == ChattyChild.tokens


# A caller that reads nothing: without BDP probing its window stays at 64 KiB, so the
# proxy's writes block after about a thousand token responses.
UNREAD_OPTIONS = [("grpc.http2.bdp_probe", 0)]


class TokenChild(pb_grpc.GRPCInferenceServiceServicer):
    """Streams ``tokens`` token responses per request as fast as it is read (no counts),
    the last marked final; ``answered`` counts the answers it sent to their end."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.answered = 0

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        async for request in requests:
            for i in range(self.tokens):
                response = text_response(request, f" tok{i}", final=i == self.tokens - 1)
                await context.write(pb.ModelStreamInferResponse(infer_response=response))
            self.answered += 1


async def test_a_caller_that_stops_reading_holds_no_lease_past_its_answer_and_loses_nothing(
    front: Make,
) -> None:
    """The caller reads nothing while its answer is made: the proxy's writes block, but
    it reads its child's answer to the end and gives the lease back at once (the GPU
    slot, at the local tier), holding the text merged. Read later, every token comes
    exactly once, in order, in fewer messages than tokens, the count right."""
    tokens = 6000
    child = TokenChild(tokens)
    f = await front(Limits(stream_write_timeout_s=20.0), servicer=child)
    async with grpc.aio.insecure_channel(f.address, options=UNREAD_OPTIONS) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(timeout=30)
        await call.write(generate_request(MODEL, "hi", 8, request_id="r", stream=True))
        await call.done_writing()
        for _ in range(300):  # the answer made, the lease back, nothing read yet
            if child.answered and [c.outstanding_requests for c in f.children] == [0]:
                break
            await asyncio.sleep(0.01)
        assert child.answered == 1
        assert [c.outstanding_requests for c in f.children] == [0]
        assert not call.done()  # the caller has read nothing: the proxy still writes
        responses = [r async for r in call]
        assert await call.code() == grpc.StatusCode.OK
    text = "".join(response_text(r.infer_response) for r in responses)
    assert text == "".join(f" tok{i}" for i in range(tokens))
    assert len(responses) < tokens
    last = responses[-1].infer_response.parameters
    assert last["triton_final_response"].bool_param
    assert last["completion_tokens"].int64_param == tokens
