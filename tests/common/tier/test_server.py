"""TierServer wires the call's observers: at the edge, metrics, the server span and the
usage record all name the tenant the API key authenticated (not ``-``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from common.basics.redis_embed import EmbeddedRedis
from common.config.access import AuthConfig, TenantConfig
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability import tracing as tm
from common.observability.metrics import counter_values
from common.observability.tier_metrics import REQUEST_LABELS, STREAM_LABELS
from common.request.server import V2Server
from common.request.v2 import generate_request, response_text
from common.tenancy.auth import hash_key
from common.tier.server import TierServer
from tests.common.request.test_forwarding_loop import MODEL, ChildServer
from tests.common.tenancy.test_admission import records_with
from tests.common.tier.edge import edge_tier
from tests.until import until

ACME = TenantConfig(id="acme", key_hashes=frozenset({hash_key("mk_acme")}))


@dataclass
class Edge:
    tier: TierServer
    stub: pb_grpc.GRPCInferenceServiceStub
    telemetry: tm.Telemetry
    stopped: bool = False

    async def stop(self) -> None:
        """Stop the tier (flushing its usage records), once."""
        if not self.stopped:
            self.stopped = True
            await self.tier.stop(0)


@pytest.fixture
async def edge(redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Edge]:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    for name in ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    telemetry = tm.setup_tracing("test-edge")
    child = V2Server(ChildServer("us-east"), Endpoint("127.0.0.1", 0))
    await child.start()
    auth = AuthConfig(enabled=True, tenants=(ACME,))
    tier = edge_tier(child, auth, redis_server.url, telemetry)
    await tier.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{tier.port}")
    edge = Edge(tier, pb_grpc.GRPCInferenceServiceStub(channel), telemetry)
    try:
        yield edge
    finally:
        await channel.close()
        await edge.stop()
        await child.stop(0)


def server_spans(edge: Edge, method: str) -> list[ReadableSpan]:
    assert edge.telemetry.recent is not None
    spans = edge.telemetry.recent.spans()
    return [s for s in spans if s.name == tm.span_name(method) and s.kind == SpanKind.SERVER]


def requests_counted(tier: TierServer) -> dict[tuple[str, ...], float]:
    return counter_values(tier.metrics.requests, REQUEST_LABELS)


async def test_the_edge_counts_traces_and_bills_the_authenticated_tenant(
    edge: Edge, redis_server: EmbeddedRedis
) -> None:
    request = generate_request(MODEL, "hello there", 7)
    await edge.stub.ModelInfer(request, metadata=[("authorization", "Bearer mk_acme")], timeout=5)
    expected = {("global", MODEL, "OK", "acme"): 1.0}
    await until(lambda: requests_counted(edge.tier) == expected, what="for the request counter")
    assert edge.telemetry.recent is not None
    [server_span] = server_spans(edge, "ModelInfer")
    assert server_span.attributes is not None
    assert server_span.attributes[tm.TENANT] == "acme"
    assert server_span.attributes[tm.GPU] == "us-east"
    trace_id = format(server_span.get_span_context().trace_id, "032x")
    await edge.stop()
    [record] = records_with(redis_server, trace_id)
    assert (record.tenant, record.model, record.status) == ("acme", MODEL, "OK")
    assert (record.completion_tokens, record.region) == (7, "us-east")
    assert record.prompt_tokens > 0


async def test_an_unknown_key_is_unauthenticated_counted_without_a_tenant_and_not_billed(
    edge: Edge, redis_server: EmbeddedRedis
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await edge.stub.ModelInfer(
            generate_request(MODEL, "hi"), metadata=[("authorization", "Bearer mk_nobody")],
            timeout=5,
        )  # fmt: skip
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Counted as the call ends, which may be just after the client saw the abort.
    expected = {("global", MODEL, "UNAUTHENTICATED", "-"): 1.0}
    await until(lambda: requests_counted(edge.tier) == expected, what="for the request counter")
    assert edge.telemetry.recent is not None
    [server_span] = server_spans(edge, "ModelInfer")
    trace_id = format(server_span.get_span_context().trace_id, "032x")
    await edge.stop()
    assert records_with(redis_server, trace_id) == []


async def test_the_edge_counts_and_bills_each_request_of_a_stream(
    edge: Edge, redis_server: EmbeddedRedis
) -> None:
    """Two requests on one stream: two requests counted, one stream counted, two usage
    records (each with its own tokens) under the stream's one trace."""
    requests = [
        generate_request(MODEL, "one two", 5, request_id="a", stream=True),
        generate_request(MODEL, "one two three", 9, request_id="b", stream=True),
    ]
    call = edge.stub.ModelStreamInfer(
        iter(requests), metadata=[("authorization", "Bearer mk_acme")], timeout=5
    )
    texts = [response_text(r.infer_response) async for r in call]
    assert texts == ["us-east", "us-east"]
    assert requests_counted(edge.tier) == {("global", MODEL, "OK", "acme"): 2.0}
    streams = counter_values(edge.tier.metrics.streams, STREAM_LABELS)
    assert streams == {("global", "OK", "acme"): 1.0}
    assert edge.telemetry.recent is not None
    [server_span] = server_spans(edge, "ModelStreamInfer")
    trace_id = format(server_span.get_span_context().trace_id, "032x")
    await edge.stop()
    records = records_with(redis_server, trace_id)
    # The child answers one token per request, whatever max_tokens asked for.
    assert sorted((r.prompt_tokens, r.completion_tokens, r.status) for r in records) == [
        (2, 1, "OK"),
        (3, 1, "OK"),
    ]
    assert {r.tenant for r in records} == {"acme"}
    assert len({r.request_id for r in records}) == 2
