"""The call interceptor: one CallRecord per inference call, shared by its observers."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.call import CallInterceptor, CallRecord, current_call
from common.request.openai_call import CallAborted, HttpCallContext
from common.request.server import V2Server
from common.request.v2 import generate_request, text_response
from tests.cyclic import free_unreachable, unreachable_now


class Handler(pb_grpc.GRPCInferenceServiceServicer):
    """Writes what it learns into the call's record, as the proxy does."""

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        call = current_call("ModelInfer", context.invocation_metadata())
        call.model = request.model_name
        if request.id == "missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
        left = context.time_remaining()
        if request.id == "late" and left is not None:  # too busy to see the deadline pass
            time.sleep(left + 0.05)  # noqa: ASYNC251 (grpc must not cancel it first)
        call.route = "zone/gpu-1"
        return text_response(request, "ok")

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        call = current_call("ModelStreamInfer", context.invocation_metadata())
        async for request in requests:
            if request.id == "own-record":  # as the stream relay reports a request
                one = call.for_request()
                one.model, one.completion_tokens = request.model_name, 2
                one.code = grpc.StatusCode.OK
                call.request_ended(one)
                continue
            call.model = request.model_name
            call.completion_tokens += 1
            await context.write(pb.ModelStreamInferResponse(infer_response=text_response(
                request, "t"
            )))  # fmt: skip


@dataclass
class Observer:
    name: str
    events: list[tuple[str, str, CallRecord]] = field(default_factory=list)

    def call_started(self, call: CallRecord) -> None:
        self.events.append(("started", self.name, call))

    def call_ended(self, call: CallRecord) -> None:
        self.events.append(("ended", self.name, call))


@pytest.fixture
async def served() -> AsyncIterator[tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]]]:
    events: list[tuple[str, str, CallRecord]] = []
    first, second = Observer("first", events), Observer("second", events)
    server = V2Server(
        Handler(), Endpoint("127.0.0.1", 0), interceptors=[CallInterceptor([first, second])]
    )
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield pb_grpc.GRPCInferenceServiceStub(channel), events
    finally:
        await channel.close()
        await server.stop(0)


async def test_observers_start_in_order_and_end_in_reverse_sharing_one_record(
    served: tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]],
) -> None:
    stub, events = served
    await stub.ModelInfer(generate_request("m", "hi"), timeout=5)
    assert [(kind, name) for kind, name, _ in events] == [
        ("started", "first"),
        ("started", "second"),
        ("ended", "second"),
        ("ended", "first"),
    ]
    records = {id(call) for _, _, call in events}
    assert len(records) == 1
    call = events[-1][2]
    assert (call.method, call.model, call.route, call.code) == (
        "ModelInfer", "m", "zone/gpu-1", grpc.StatusCode.OK
    )  # fmt: skip
    assert call.elapsed_s >= 0


async def test_an_aborted_call_ends_with_its_status_and_message(
    served: tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]],
) -> None:
    stub, events = served
    request = generate_request("m", "hi", request_id="missing")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # abort() sends the status before the handler unwinds through the interceptor.
    for _ in range(100):
        if len(events) == 4:
            break
        await asyncio.sleep(0.01)
    call = events[-1][2]
    assert (call.code, call.detail, call.route) == (grpc.StatusCode.NOT_FOUND, "no such model", "")


async def test_an_answer_ready_after_the_callers_deadline_ends_the_call_as_exceeded(
    served: tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]],
) -> None:
    """The handler's loop was busy through the deadline (grpc.aio could not cancel
    it), so it returned an answer the caller never got: the observers (the usage
    record) see DEADLINE_EXCEEDED, what the caller saw, never OK."""
    stub, events = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(generate_request("m", "hi", request_id="late"), timeout=0.1)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):
        if len(events) == 4:
            break
        await asyncio.sleep(0.01)
    call = events[-1][2]
    assert call.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert call.detail == "answered after the caller's deadline"


async def test_a_stream_is_one_call_with_what_its_handler_counted(
    served: tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]],
) -> None:
    stub, events = served
    call = stub.ModelStreamInfer(timeout=5)
    for i in range(3):
        await call.write(generate_request("m", "hi", request_id=str(i), stream=True))
    await call.done_writing()
    assert len([r async for r in call]) == 3
    assert [(kind, name) for kind, name, _ in events][-1] == ("ended", "first")
    record = events[-1][2]
    assert (record.method, record.completion_tokens, record.code) == (
        "ModelStreamInfer", 3, grpc.StatusCode.OK
    )  # fmt: skip


async def test_other_methods_are_not_observed(
    served: tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]],
) -> None:
    stub, events = served
    assert (await stub.ServerLive(pb.ServerLiveRequest(), timeout=5)).live
    assert events == []


def test_without_the_interceptor_the_proxy_gets_a_record_nobody_observes() -> None:
    call = current_call("ModelInfer", None)
    assert (call.method, call.tenant, call.trace_id) == ("ModelInfer", "", "")


async def test_a_streams_requests_reach_the_observers_on_records_of_their_own(
    served: tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]],
) -> None:
    stub, events = served
    call = stub.ModelStreamInfer(timeout=5)
    for _ in range(2):
        await call.write(generate_request("m", "hi", request_id="own-record", stream=True))
    await call.done_writing()
    assert [r async for r in call] == []
    # Each request: ended only (no start: no server span of its own), in reverse order.
    kinds = [(kind, name, rec.carries_requests) for kind, name, rec in events]
    assert kinds == [
        ("started", "first", True),
        ("started", "second", True),
        ("ended", "second", False),
        ("ended", "first", False),
        ("ended", "second", False),
        ("ended", "first", False),
        ("ended", "second", True),
        ("ended", "first", True),
    ]
    stream = events[-1][2]
    requests = {id(rec): rec for _, _, rec in events if not rec.carries_requests}
    assert len(requests) == 2
    assert all(rec.stream is stream and rec.completion_tokens == 2 for rec in requests.values())
    assert (stream.requests, stream.completion_tokens, stream.code) == (2, 4, grpc.StatusCode.OK)


async def test_each_call_of_a_method_gets_a_record_of_its_own_metadata(
    served: tuple[pb_grpc.GRPCInferenceServiceStub, list[Any]],
) -> None:
    """The observed handler is built once per method; what it records is each call's."""
    stub, events = served
    for session in ("one", "two", "three"):
        request = generate_request("m", "hi")
        await stub.ModelInfer(request, metadata=[("x-meridian-session", session)], timeout=5)
    ended = [call for kind, name, call in events if kind == "ended" and name == "first"]
    sessions = [dict(call.metadata).get("x-meridian-session") for call in ended]
    assert sessions == ["one", "two", "three"]
    assert len({id(call) for call in ended}) == 3


async def test_a_failed_call_leaves_the_interceptor_no_cycle_to_free() -> None:
    """The error a handler ends with is the observer's to read, not to keep: its
    traceback holds the interceptor's frame, and the frame holding it would make a
    cycle per failed call that only the cyclic GC frees."""
    context = HttpCallContext((), None)  # a real servicer context, the OpenAI edge's

    async def refused() -> None:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such model (cycle check)")

    events: list[tuple[str, str, CallRecord]] = []
    interceptor = CallInterceptor([Observer("only", events)])
    gc.disable()
    try:
        free_unreachable()  # what earlier tests left
        with pytest.raises(CallAborted):
            await interceptor.observe("ModelInfer", (), context, refused())
        left = unreachable_now()
    finally:
        gc.enable()
    assert events[-1][2].code == grpc.StatusCode.NOT_FOUND
    assert [o for o in left if isinstance(o, CallAborted) and "cycle check" in str(o)] == []
