"""The per-try timeout through the real forwarding loop, over real gRPC on loopback.

A proxy over two child V2 servers; the first stalls. An attempt that has sent
nothing back within its limit is cancelled (the child sees its call cancelled) and
the request moves to the next child; an attempt that has sent a byte is never cut;
a limit the caller's deadline comes before is the caller's deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from common.config.liveness import PerTryTimeout
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.children import Child
from common.request.forwarding import ForwardingPolicy
from common.request.per_try import PerTryExpired, within_per_try
from common.request.pick import PickRequest
from common.request.proxy import TierSpec
from common.request.routing import ROUTE
from common.request.v2 import generate_request, response_text, text_response
from tests.common.request.front import proxy_over

MODEL = "demo-llm"
# 0.3 s for any request: the floor, and a negligible share per token.
PER_TRY = PerTryTimeout(multiple=1.0, floor_s=0.3, upper_s_per_token=1e-9)


@dataclass
class Stalling(pb_grpc.GRPCInferenceServiceServicer):
    """A child that waits ``stall_s`` before answering (a stream: after its first
    ``before_stall`` responses) and records calls it saw cancelled."""

    name: str
    stall_s: float = 0.0
    before_stall: int = 0
    seen: list[str] = field(default_factory=list)
    cancelled: int = 0

    async def _stall(self) -> None:
        try:
            await asyncio.sleep(self.stall_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        self.seen.append(request.id)
        await self._stall()
        return text_response(request, self.name)

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        sent = 0
        async for request in requests:
            self.seen.append(request.id)
            for _ in range(3):
                if sent == self.before_stall:
                    await self._stall()
                sent += 1
                response = text_response(request, self.name, final=False)
                await context.write(pb.ModelStreamInferResponse(infer_response=response))


class InOrder:
    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        return sorted(children, key=lambda c: c.name)


@dataclass
class Rig:
    stub: pb_grpc.GRPCInferenceServiceStub
    first: Stalling
    second: Stalling


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    first, second = Stalling("a", stall_s=5.0), Stalling("b")
    spec = TierSpec(tier="regional", trust_internal=True, resolve_origin=lambda hints: None)
    policy = ForwardingPolicy(kind="zone", route_prefix="r", per_try=PER_TRY)
    named = [("a", first), ("b", second)]
    async with proxy_over(named, model=MODEL, spec=spec, policy=policy) as f:
        yield Rig(f.stub, first, second)


async def test_a_unary_attempt_that_stalls_is_cancelled_and_moves_on(rig: Rig) -> None:
    started = time.monotonic()
    call = rig.stub.ModelInfer(generate_request(MODEL, "hi", request_id="1"), timeout=10)
    assert response_text(await call) == "b"
    assert dict(await call.trailing_metadata())[ROUTE] == "r/b"
    assert 0.3 <= time.monotonic() - started < 2.0
    await asyncio.sleep(0.1)
    assert rig.first.seen == ["1"] and rig.first.cancelled == 1  # a stopped working on it


async def stream(rig: Rig, ids: Sequence[str], timeout: float = 10) -> tuple[list[str], str]:
    call = rig.stub.ModelStreamInfer(timeout=timeout)
    for i in ids:
        await call.write(generate_request(MODEL, "hi", request_id=i, stream=True))
    await call.done_writing()
    texts = [response_text(r.infer_response) async for r in call]
    return texts, str(dict(await call.trailing_metadata())[ROUTE])


async def test_stream_requests_that_stall_before_their_first_byte_each_move_on(rig: Rig) -> None:
    texts, route = await stream(rig, ["1", "2"])
    # Six tokens from b; tokens that came while the relay was writing go up joined.
    assert "".join(texts) == "b" * 6 and len(texts) <= 6 and route == "r/b"
    # Each request of the stream is its own attempt: both moved to b, in either order.
    assert sorted(rig.second.seen) == ["1", "2"]


async def test_a_stream_that_stalls_after_its_first_byte_is_never_cut(rig: Rig) -> None:
    rig.first.stall_s, rig.first.before_stall = 0.6, 1  # twice the limit, once committed
    texts, route = await stream(rig, ["1"])
    assert "".join(texts) == "a" * 3 and route == "r/a"
    assert rig.first.cancelled == 0 and rig.second.seen == []


async def test_a_limit_past_the_callers_deadline_leaves_it_the_callers(rig: Rig) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rig.stub.ModelInfer(generate_request(MODEL, "hi", request_id="1"), timeout=0.25)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert rig.second.seen == []


# ------------------------------------------------------------------ within_per_try


async def test_within_per_try_without_a_limit_is_the_plain_await() -> None:
    assert await within_per_try(asyncio.sleep(0.01, "done"), lambda: False, None) == "done"


async def test_within_per_try_raises_per_try_expired_naming_its_limit() -> None:
    with pytest.raises(PerTryExpired, match=r"nothing back within 0\.05s"):
        await within_per_try(asyncio.sleep(5), lambda: False, 0.05)


async def test_within_per_try_does_not_swallow_the_callers_cancellation() -> None:
    task = asyncio.create_task(within_per_try(asyncio.sleep(5), lambda: False, 1.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_expiry_leaves_the_task_uncancelled_for_the_next_attempt() -> None:
    with pytest.raises(PerTryExpired):
        await within_per_try(asyncio.sleep(5), lambda: False, 0.02)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    # The failover's next attempt runs in the same task, to its end.
    assert await within_per_try(asyncio.sleep(0.01, "next"), lambda: False, 1.0) == "next"


async def test_a_committed_attempt_runs_past_its_limit() -> None:
    assert await within_per_try(asyncio.sleep(0.1, "whole"), lambda: True, 0.02) == "whole"


async def test_the_callers_cancellation_during_an_expiry_stays_a_cancellation() -> None:
    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # cleaning up when the caller gives up too
            raise

    task = asyncio.create_task(within_per_try(slow_to_stop(), lambda: False, 0.02))
    await asyncio.sleep(0.1)  # the limit has passed; the attempt is stopping
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# ------------------------------------------------------------------ the limit


@pytest.mark.parametrize(
    ("per_try", "expected_s", "work", "limit"),
    [
        (PerTryTimeout(), 0.5, 100.0, 1.0 + 4 * 0.5),
        (PerTryTimeout(), None, 100.0, None),  # an upper tier without a configured rate
        (PerTryTimeout(upper_s_per_token=0.01), None, 100.0, 1.0 + 4 * 1.0),
        (PerTryTimeout(enabled=False), 0.5, 100.0, None),
    ],
    ids=["local-estimate", "upper-tier-off", "upper-tier-configured", "disabled"],
)
def test_per_try_limit(
    per_try: PerTryTimeout, expected_s: float | None, work: float, limit: float | None
) -> None:
    assert per_try.limit_s(expected_s, work) == pytest.approx(limit)
