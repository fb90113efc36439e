"""A child whose ModelStreamInfer is not Triton's, as MLServer's is (it streams
``ModelInferResponse`` messages), against a real grpc.aio server speaking that dialect:
the first answer is recognised before anything is written back, and the request (and
every later one) goes as ModelInfer, answered in one stream response."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.children import Child
from common.request.stream_request import StreamRequestAttempt
from common.request.v2 import generate_request, parse_generate, response_text, text_response

SERVICE = "inference.GRPCInferenceService"


@dataclass
class MlserverDialect:
    """MLServer's V2 service as it is on the wire: ModelStreamInfer answers each request
    with a ``ModelInferResponse`` (not a ``ModelStreamInferResponse``)."""

    model_version: str = ""
    calls: list[str] = field(default_factory=list)

    def answer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        response = text_response(request, f"echo: {parse_generate(request).prompt}")
        response.model_version = self.model_version
        response.id = "6f1c2a3b-mlserver-sets-an-id"
        return response

    async def infer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        self.calls.append("ModelInfer")
        return self.answer(request)

    async def stream(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelInferResponse]:
        self.calls.append("ModelStreamInfer")
        async for request in requests:
            yield self.answer(request)

    def handler(self) -> grpc.GenericRpcHandler:
        read, write = pb.ModelInferRequest.FromString, pb.ModelInferResponse.SerializeToString
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "ModelInfer": grpc.unary_unary_rpc_method_handler(self.infer, read, write),
                "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                    self.stream, read, write
                ),
            },
        )


@dataclass
class Served:
    dialect: MlserverDialect
    child: Child


@pytest.fixture(params=["", "1"], ids=["no-model-version", "model-version"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    """With a model version MLServer's answer does not even parse as a stream response."""
    dialect = MlserverDialect(model_version=request.param)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((dialect.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    child = Child("gpu-mlserver", Endpoint("127.0.0.1", port), frozenset({"m"}))
    child.stub, child.channel = pb_grpc.GRPCInferenceServiceStub(channel), channel
    try:
        yield Served(dialect, child)
    finally:
        await channel.close()
        await server.stop(0)


async def stream_once(child: Child, prompt: str) -> list[pb.ModelStreamInferResponse]:
    written: list[pb.ModelStreamInferResponse] = []

    async def write(response: pb.ModelStreamInferResponse) -> None:
        written.append(response)

    attempt = StreamRequestAttempt(generate_request("m", prompt, 4, stream=True), write)
    await attempt.send(child, (), timeout=5.0)
    assert attempt.whole and attempt.committed and not attempt.error
    return written


async def test_a_stream_to_a_server_whose_stream_is_not_tritons_goes_as_model_infer(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="common.request.stream_request")
    first = await stream_once(served.child, "hello")
    # One response, the whole text, and not the model's name read as an error.
    assert [r.error_message for r in first] == [""]
    assert response_text(first[0].infer_response) == "echo: hello"
    assert served.child.streams is False
    second = await stream_once(served.child, "again")
    assert response_text(second[0].infer_response) == "echo: again"
    # The first request ran twice (once on the stream it could not answer); after that,
    # ModelInfer only.
    assert served.dialect.calls == ["ModelStreamInfer", "ModelInfer", "ModelInfer"]
    events = [r for r in caplog.records if getattr(r, "event", None) == "gpu_stream_unary"]
    assert len(events) == 1 and getattr(events[0], "child", None) == "gpu-mlserver"


async def test_a_tritons_error_message_is_relayed_not_taken_for_a_foreign_stream() -> None:
    """Triton's own error answers (no unknown fields) still reach the caller as they are."""

    class Failing(pb_grpc.GRPCInferenceServiceServicer):
        async def ModelStreamInfer(self, requests: Any, context: Any) -> Any:
            async for _ in requests:
                yield pb.ModelStreamInferResponse(error_message="UNAVAILABLE: model unloading")

    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Failing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    child = Child("gpu-triton", Endpoint("127.0.0.1", port), frozenset({"m"}))
    child.stub = pb_grpc.GRPCInferenceServiceStub(channel)
    written: list[pb.ModelStreamInferResponse] = []

    async def write(response: pb.ModelStreamInferResponse) -> None:
        written.append(response)

    attempt = StreamRequestAttempt(generate_request("m", "hi", 4, stream=True), write)
    try:
        await attempt.send(child, (), timeout=5.0)
    finally:
        await channel.close()
        await server.stop(0)
    assert [r.error_message for r in written] == ["UNAVAILABLE: model unloading"]
    assert attempt.error == "UNAVAILABLE: model unloading" and not attempt.whole
    assert child.streams is True
