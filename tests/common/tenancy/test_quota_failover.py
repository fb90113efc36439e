"""A tenant-quota refusal is never failed over; load shed for capacity still is.

A regional-style proxy over two child V2 servers, through real gRPC on loopback:
the first child refuses with RESOURCE_EXHAUSTED, with or without the
``x-meridian-quota`` trailer; the second would serve.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from common.basics.errors import RETRY_AFTER_MS, TENANT_QUOTA, RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.v2 import generate_request, response_text, text_response
from tests.common.request.front import proxy_over
from tests.common.request.test_forwarding_loop import MODEL


@dataclass
class Refusing(pb_grpc.GRPCInferenceServiceServicer):
    """Answers with its name, or refuses with ``refusal`` (its trailers included)."""

    name: str
    refusal: RouteError | None = None
    seen: list[str] = field(default_factory=list)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        self.seen.append(request.id)
        if self.refusal is not None:
            err = self.refusal
            await context.abort(err.code, err.message, trailing_metadata=err.trailers)
        return text_response(request, self.name)

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        async for request in requests:
            self.seen.append(request.id)
        if self.refusal is not None:
            err = self.refusal
            await context.abort(err.code, err.message, trailing_metadata=err.trailers)
        await context.write(
            pb.ModelStreamInferResponse(infer_response=text_response(request, self.name))
        )


@dataclass
class Pair:
    stub: pb_grpc.GRPCInferenceServiceStub
    first: Refusing
    second: Refusing


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    first, second = Refusing("a"), Refusing("b")
    spec = TierSpec(tier="global", trust_internal=False, resolve_origin=lambda hints: None)
    policy = ForwardingPolicy(kind="region")
    named = [("a", first), ("b", second)]
    async with proxy_over(named, model=MODEL, spec=spec, policy=policy) as f:
        yield Pair(f.stub, first, second)


OVER_QUOTA = RouteError.over_quota("tenant 'acme' has 4 requests in flight", 100, "max_concurrent")
SHED = RouteError.exhausted("local queue is full", 250)


async def unary(pair: Pair) -> tuple[str, dict[str, str]]:
    call = pair.stub.ModelInfer(generate_request(MODEL, "hi", request_id="1"), timeout=5)
    response = await call
    return response_text(response), dict(await call.trailing_metadata())


async def test_a_tenant_quota_refusal_is_not_failed_over(pair: Pair) -> None:
    pair.first.refusal = OVER_QUOTA
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await unary(pair)
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 requests in flight" in (err.details() or "")
    trailers = dict(err.trailing_metadata() or ())
    assert trailers[RETRY_AFTER_MS] == "100" and trailers[TENANT_QUOTA] == "max_concurrent"
    assert pair.second.seen == []  # never sent to the other region


async def test_load_shed_for_capacity_still_fails_over(pair: Pair) -> None:
    pair.first.refusal = SHED
    text, _ = await unary(pair)
    assert text == "b"
    assert pair.first.seen == ["1"] and pair.second.seen == ["1"]


async def stream(pair: Pair, ids: Sequence[str]) -> list[pb.ModelStreamInferResponse]:
    call = pair.stub.ModelStreamInfer(timeout=5)
    for i in ids:
        await call.write(generate_request(MODEL, "hi", request_id=i))
    await call.done_writing()
    return [r async for r in call]


async def test_a_stream_request_refused_for_quota_is_not_sent_elsewhere(pair: Pair) -> None:
    pair.first.refusal = OVER_QUOTA
    responses = await stream(pair, ["1", "2"])
    # Each request of the stream is refused on its own; the stream itself goes on.
    errors = sorted(r.error_message for r in responses)
    assert len(errors) == 2
    assert all(e.startswith("RESOURCE_EXHAUSTED") for e in errors), errors
    assert "request id '1'" in errors[0] and "request id '2'" in errors[1]
    assert pair.second.seen == []


async def test_a_stream_request_shed_for_capacity_is_sent_elsewhere(pair: Pair) -> None:
    pair.first.refusal = SHED
    responses = await stream(pair, ["1", "2"])
    assert [response_text(r.infer_response) for r in responses] == ["b", "b"]
    assert sorted(pair.second.seen) == ["1", "2"]
