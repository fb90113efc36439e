"""The one forwarding loop, unary and streaming, through real gRPC on loopback.

A proxy over two child V2 servers whose behaviour each test sets: failover
before the first response byte, none after it, and none for codes the tier does
not fail over on; the route trailer names the child that answered; every lease
is given back whatever happened.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.children import ChildSet
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.routing import ROUTE
from common.request.v2 import generate_request, response_text, text_response
from tests.common.request.front import proxy_over

MODEL = "demo-llm"


@dataclass
class ChildServer(pb_grpc.GRPCInferenceServiceServicer):
    """A child V2 server: answers ``tokens`` responses per streamed request, or fails
    with ``code`` once it has sent ``before_failing`` responses (over all its calls)."""

    name: str
    code: grpc.StatusCode | None = None
    before_failing: int = 0
    tokens: int = 1
    seen: list[str] = field(default_factory=list)
    sent: int = 0

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        self.seen.append(request.id)
        if self.code is not None:
            await context.abort(self.code, f"{self.name} refuses")
        return text_response(request, self.name)

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        if self.code is not None and not self.before_failing:
            # Fail only once the caller is done writing: grpc core may report an abort
            # that races with the caller's writes as INTERNAL instead of this code.
            self.seen.extend([r.id async for r in requests])
            await context.abort(self.code, f"{self.name} refuses")
        async for request in requests:
            self.seen.append(request.id)
            for i in range(self.tokens):
                if self.code is not None and self.sent >= self.before_failing:
                    await context.abort(self.code, f"{self.name} refuses")
                self.sent += 1
                final = i == self.tokens - 1
                await context.write(
                    pb.ModelStreamInferResponse(
                        infer_response=text_response(request, self.name, final=final)
                    )
                )


@dataclass
class Rig:
    stub: pb_grpc.GRPCInferenceServiceStub
    first: ChildServer
    second: ChildServer
    children: ChildSet


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    first, second = ChildServer("a"), ChildServer("b")
    spec = TierSpec(tier="regional", trust_internal=True, resolve_origin=lambda hints: None)
    policy = ForwardingPolicy(kind="zone", route_prefix="r")
    named = [("a", first), ("b", second)]
    async with proxy_over(named, model=MODEL, spec=spec, policy=policy) as f:
        yield Rig(f.stub, first, second, f.children)


async def test_unary_answer_carries_the_route_of_the_child_that_answered(rig: Rig) -> None:
    call = rig.stub.ModelInfer(generate_request(MODEL, "hi", request_id="1"), timeout=5)
    response = await call
    assert response_text(response) == "a"
    assert dict(await call.trailing_metadata())[ROUTE] == "r/a"


async def test_unary_fails_over_on_unavailable_to_the_next_child(rig: Rig) -> None:
    rig.first.code = grpc.StatusCode.UNAVAILABLE
    call = rig.stub.ModelInfer(generate_request(MODEL, "hi", request_id="1"), timeout=5)
    assert response_text(await call) == "b"
    assert dict(await call.trailing_metadata())[ROUTE] == "r/b"
    assert rig.first.seen == ["1"] and rig.second.seen == ["1"]


async def test_unary_does_not_fail_over_on_invalid_argument(rig: Rig) -> None:
    rig.first.code = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rig.stub.ModelInfer(generate_request(MODEL, "hi", request_id="1"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a refuses" in (caught.value.details() or "")
    assert rig.second.seen == []


async def test_unary_with_every_child_down_is_unavailable_naming_each(rig: Rig) -> None:
    rig.first.code = rig.second.code = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rig.stub.ModelInfer(generate_request(MODEL, "hi", request_id="1"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    details = caught.value.details() or ""
    assert "a: UNAVAILABLE" in details and "b: UNAVAILABLE" in details


async def stream(rig: Rig, ids: Sequence[str]) -> tuple[list[str], Any]:
    call = rig.stub.ModelStreamInfer(timeout=5)
    for i in ids:
        await call.write(generate_request(MODEL, "hi", request_id=i, stream=True))
    await call.done_writing()
    texts = []
    async for response in call:
        texts.append(response.error_message or response_text(response.infer_response))
    return texts, await call.trailing_metadata()


async def test_stream_requests_fail_over_before_their_first_byte(rig: Rig) -> None:
    rig.first.code = grpc.StatusCode.UNAVAILABLE
    texts, trailers = await stream(rig, ["1", "2"])
    assert texts == ["b", "b"]
    assert dict(trailers)[ROUTE] == "r/b"
    assert sorted(rig.first.seen) == sorted(rig.second.seen) == ["1", "2"]


async def test_a_stream_request_does_not_fail_over_once_one_of_its_responses_went_back(
    rig: Rig,
) -> None:
    """Its failure is an error_message naming it (Triton's way); the stream ends OK."""
    rig.first.code, rig.first.before_failing, rig.first.tokens = grpc.StatusCode.UNAVAILABLE, 1, 2
    texts, _ = await stream(rig, ["1"])
    assert texts == ["a", "UNAVAILABLE: a refuses (request id '1')"]
    assert rig.second.seen == []


async def test_each_stream_request_fails_over_on_its_own(rig: Rig) -> None:
    """The first request a answers; the other, with none of its responses sent yet,
    moves to b although the stream has already sent a response."""
    rig.first.code, rig.first.before_failing = grpc.StatusCode.UNAVAILABLE, 1
    texts, _ = await stream(rig, ["1", "2"])
    assert sorted(texts) == ["a", "b"]
    assert sorted(rig.first.seen) == ["1", "2"] and len(rig.second.seen) == 1


async def test_stream_invalid_request_gets_an_error_message_and_goes_on(rig: Rig) -> None:
    call = rig.stub.ModelStreamInfer(timeout=5)
    await call.write(pb.ModelInferRequest(model_name=MODEL, id="bad"))  # no text_input
    await call.write(generate_request(MODEL, "hi", request_id="1", stream=True))
    await call.done_writing()
    responses = [r async for r in call]
    assert responses[0].error_message.startswith("INVALID_ARGUMENT")
    assert response_text(responses[1].infer_response) == "a"
    assert rig.first.seen == ["1"]
