"""A real OTLP trace receiver for tests: OTLP/gRPC (a grpc.aio ``TraceService``) or
OTLP/HTTP (aiohttp, ``POST /v1/traces`` with ``application/x-protobuf``), both built on
the ``opentelemetry-proto`` messages, keeping every span that arrives.

``otlp_receiver(protocol)`` starts one on a loopback port and stops it on exit; the
exporters under test reach it through ``endpoint`` (``OTEL_EXPORTER_OTLP_ENDPOINT``).
"""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as svc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as svc_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from common.basics.redis_embed import free_port

KINDS = {
    ProtoSpan.SPAN_KIND_SERVER: "server",
    ProtoSpan.SPAN_KIND_CLIENT: "client",
    ProtoSpan.SPAN_KIND_INTERNAL: "internal",
}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived, with the ``service.name`` of the resource that sent it."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    error: bool


@dataclass
class Received:
    """Every span the receiver was sent, and what each request to it looked like."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)

    def add(self, request: svc.ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            kind=KINDS.get(span.kind, str(span.kind)),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            error=span.status.code == span.status.STATUS_CODE_ERROR,
                        )
                    )

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        out: dict[str, list[ReceivedSpan]] = {}
        for span in self.spans:
            out.setdefault(span.trace_id, []).append(span)
        return out

    async def wait_for(self, done: Callable[[Received], bool], timeout_s: float = 10.0) -> None:
        """Until ``done(self)`` (the exporters batch: spans arrive a moment after the call)."""
        deadline = time.monotonic() + timeout_s
        while not done(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver has only {len(self.spans)} spans")
            await asyncio.sleep(0.05)


class TraceService(svc_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    async def Export(
        self, request: svc.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> svc.ExportTraceServiceResponse:
        self.received.content_types.append("grpc")
        self.received.add(request)
        return svc.ExportTraceServiceResponse()


@asynccontextmanager
async def _grpc_receiver(received: Received) -> AsyncIterator[str]:
    server = grpc.aio.server()
    svc_grpc.add_TraceServiceServicer_to_server(TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.stop(0)


@asynccontextmanager
async def _http_receiver(received: Received) -> AsyncIterator[str]:
    async def export(request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text=f"not protobuf: {request.content_type}")
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = svc.ExportTraceServiceRequest()
        message.ParseFromString(body)
        received.content_types.append(request.content_type)
        received.add(message)
        answer = svc.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    # An exporter's kept-alive connection must not hold the test up for a minute.
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def otlp_receiver(protocol: str) -> AsyncIterator[tuple[Received, str]]:
    """A receiver for ``protocol`` (``grpc`` or ``http/protobuf``) and its endpoint URL."""
    received = Received()
    start = _grpc_receiver if protocol == "grpc" else _http_receiver
    async with start(received) as endpoint:
        yield received, endpoint
