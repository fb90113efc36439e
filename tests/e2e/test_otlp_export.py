"""Spans of a real tier chain (global → regional → local → emulated GPUs) exported to a real
OTLP receiver, over OTLP/gRPC and OTLP/HTTP, as the standard OTel variables choose.

Each tier sets up its own tracing from the environment (as a tier process does), so
each exports under its own ``service.name``; the receiver must see one trace per
request, with the RPC and GenAI semantic-convention attributes and the conventional
span names on every tier's spans, and the tiers' spans linked into one chain.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.config.topology import Topology
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability import trace_names as names
from common.request.v2 import generate_request
from common.tier.server import TierServer
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.worker import ZoneWorkers
from tests.e2e.chain import running_chain, traced_zone_topology
from tests.otlp_receiver import Received, ReceivedSpan, otlp_receiver

REGION, ZONE, MODEL = "eu", "eu-1a", "m"
TIERS = ("global", "regional", "local")
SERVICES = {"global": "meridian-global", "regional": "meridian-regional", "local": "meridian-local"}
# Per trace: a server, a pick and a client span at each of the three tiers.
SPANS_PER_TRACE = 9


@dataclass
class Chain:
    topology: Topology
    stub: pb_grpc.GRPCInferenceServiceStub
    received: Received




@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No OTel variable from outside; every request traced, batches sent every 50 ms."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield monkeypatch


@asynccontextmanager
async def tier_chain(redis_url: str, received: Received) -> AsyncIterator[Chain]:
    """The three tiers, each with the tracing ``setup_tracing`` builds from the environment."""
    topo = traced_zone_topology(redis_url, model=MODEL, region=REGION, zone=ZONE)
    workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=0.05)
    tiers: list[TierServer] = [
        build_local_tier(topo, REGION, ZONE),
        build_regional_tier(topo, REGION),
        build_global_tier(topo),
    ]
    # Stopping each tier flushes and shuts its exporter down.
    async with running_chain(topo, workers, tiers, MODEL) as stub:
        yield Chain(topo, stub, received)


def _complete(count: int) -> Callable[[Received], bool]:
    def done(received: Received) -> bool:
        traces = received.traces()
        return len(traces) >= count and all(len(s) >= SPANS_PER_TRACE for s in traces.values())

    return done


def _one(spans: list[ReceivedSpan], service: str, kind: str, name: str = "") -> ReceivedSpan:
    found = [
        s for s in spans if s.service == service and s.kind == kind and s.name.startswith(name)
    ]
    assert len(found) == 1, [(s.service, s.kind, s.name) for s in spans]
    return found[0]


def _addresses(topo: Topology) -> dict[str, tuple[str, int]]:
    """Where each tier serves, and (``"gpu"``) where its GPUs do, by child name."""
    zone = topo.zone(REGION, ZONE)
    region = next(r for r in topo.regions if r.name == REGION)
    out = {
        "global": (topo.global_tier.endpoint.host, topo.global_tier.endpoint.port),
        "regional": (region.endpoint.host, region.endpoint.port),
        "local": (zone.endpoint.host, zone.endpoint.port),
    }
    out.update({gpu.name: (gpu.endpoint.host, gpu.endpoint.port) for gpu in zone.gpus})
    return out


def _check_trace(spans: list[ReceivedSpan], topo: Topology, method: str) -> None:
    """Every tier's server, pick and client span: conventional names and attributes, one chain."""
    assert len({s.trace_id for s in spans}) == 1
    assert {s.service for s in spans} == set(SERVICES.values())
    where = _addresses(topo)
    rpc_name = f"inference.GRPCInferenceService/{method}"
    above: ReceivedSpan | None = None
    for tier in TIERS:
        server = _one(spans, SERVICES[tier], "server")
        pick = _one(spans, SERVICES[tier], "internal", "pick")
        client = _one(spans, SERVICES[tier], "client")
        assert server.name == client.name == rpc_name
        for span in (server, client):
            a = span.attributes
            assert a["rpc.system"] == "grpc"
            assert a["rpc.service"] == "inference.GRPCInferenceService"
            assert a["rpc.method"] == method
            assert a["rpc.grpc.status_code"] == 0 and a["rpc.response.status_code"] == "OK"
            assert not span.error
        s = server.attributes
        assert (s["server.address"], s["server.port"]) == where[tier]
        assert s["meridian.tier"] == tier and s["meridian.tenant"] == "anonymous"
        assert s["gen_ai.request.model"] == MODEL
        assert s["gen_ai.usage.input_tokens"] > 0 and s["gen_ai.usage.output_tokens"] > 0
        assert "meridian.usage.estimated" in s
        if method == "ModelInfer":
            assert s["gen_ai.request.max_tokens"] == 4
        child = client.attributes["meridian.child"]
        below = {"global": "regional", "regional": "local"}.get(tier, child)
        assert (client.attributes["server.address"], client.attributes["server.port"]) == (
            where[below]
        )
        assert client.attributes["meridian.attempt.index"] == 0
        assert client.attributes["meridian.attempt.actual_s"] > 0
        assert pick.attributes["meridian.child"] == child
        assert pick.attributes["meridian.decision.reason"]
        assert pick.parent_id == client.parent_id == server.span_id
        if above is not None:
            assert server.parent_id == above.span_id
        above = client
    top = _one(spans, SERVICES["global"], "server").attributes
    assert top[names.REGION] == REGION and top[names.ZONE] == ZONE and top[names.GPU]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
async def test_every_tier_exports_one_trace_per_request(
    redis_server: EmbeddedRedis, otel_env: pytest.MonkeyPatch, protocol: str
) -> None:
    async with otlp_receiver(protocol) as (received, endpoint):
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        async with tier_chain(redis_server.url, received) as chain:
            for i in range(3):
                await chain.stub.ModelInfer(generate_request(MODEL, f"hello {i}", 4), timeout=10)

            async def one_request() -> AsyncIterator[pb.ModelInferRequest]:
                yield generate_request(MODEL, "stream me", 4, stream=True)

            responses = [r async for r in chain.stub.ModelStreamInfer(one_request(), timeout=10)]
            assert responses and not any(r.error_message for r in responses)
            await received.wait_for(_complete(4))
            traces = received.traces()
            assert len(traces) == 4, {t: len(s) for t, s in traces.items()}
            by_method: dict[str, int] = {}
            for spans in traces.values():
                assert len(spans) == SPANS_PER_TRACE, [(s.service, s.name) for s in spans]
                streamed = any(s.name.endswith("/ModelStreamInfer") for s in spans)
                method = "ModelStreamInfer" if streamed else "ModelInfer"
                by_method[method] = by_method.get(method, 0) + 1
                _check_trace(spans, chain.topology, method)
            assert by_method == {"ModelInfer": 3, "ModelStreamInfer": 1}
    wanted = "grpc" if protocol == "grpc" else "application/x-protobuf"
    assert set(received.content_types) == {wanted}


async def test_a_b3_header_continues_the_callers_trace_down_every_tier(
    redis_server: EmbeddedRedis, otel_env: pytest.MonkeyPatch
) -> None:
    """With ``OTEL_PROPAGATORS=b3`` only B3 crosses the tiers: the chain still links up,
    under the trace and span the caller's ``b3`` header named."""
    trace_id, span_id = "80f198ee56343ba864fe8b2a57d3eff7", "e457b5a2e4d86bd1"
    async with otlp_receiver("grpc") as (received, endpoint):
        otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        otel_env.setenv("OTEL_PROPAGATORS", "b3")
        async with tier_chain(redis_server.url, received) as chain:
            await chain.stub.ModelInfer(
                generate_request(MODEL, "b3 please", 4),
                metadata=(("b3", f"{trace_id}-{span_id}-1"),),
                timeout=10,
            )
            await received.wait_for(_complete(1))
            traces = received.traces()
            assert list(traces) == [trace_id]
            spans = traces[trace_id]
            _check_trace(spans, chain.topology, "ModelInfer")
            assert _one(spans, SERVICES["global"], "server").parent_id == span_id
