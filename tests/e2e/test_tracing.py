"""One trace per request across global → regional → local → GPU, in-process over real gRPC.

Each tier's proxy gets the same in-memory tracer; the spans it records must form
one chain: server span per tier, a decision (``pick``) span and a client span per
forward attempt under it, and the next tier's server span under that attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from common.basics.redis_embed import EmbeddedRedis
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability import tracing as tm
from common.request.v2 import generate_request
from common.tier.server import TierServer
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.worker import ZoneWorkers
from tests.e2e.chain import running_chain, traced_zone_topology

REGION, ZONE, MODEL = "eu", "eu-1a", "m"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@dataclass
class Chain:
    stub: pb_grpc.GRPCInferenceServiceStub
    recent: tm.RecentSpans




@pytest.fixture
def max_concurrency() -> int:
    return 16


@pytest.fixture
async def chain(
    redis_server: EmbeddedRedis, max_concurrency: int, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Chain]:
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_SAMPLER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    topo = traced_zone_topology(
        redis_server.url, model=MODEL, region=REGION, zone=ZONE, max_concurrency=max_concurrency
    )
    # Every request traced here (Meridian's default samples 1 in 10).
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    telemetry = tm.setup_tracing("meridian-test")
    assert telemetry.recent is not None
    workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=0.05)
    tiers: list[TierServer] = [
        build_local_tier(topo, REGION, ZONE, telemetry=telemetry),
        build_regional_tier(topo, REGION, telemetry=telemetry),
        build_global_tier(topo, telemetry=telemetry),
    ]
    try:
        async with running_chain(topo, workers, tiers, MODEL) as stub:
            telemetry.recent.clear()
            yield Chain(stub, telemetry.recent)
    finally:
        telemetry.shutdown()


def _hex(span_id: int) -> str:
    return format(span_id, "016x")


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _only(spans: list[ReadableSpan], tier: str, kind: SpanKind, name: str = "") -> ReadableSpan:
    """The one span of ``kind`` (named ``name``…) of a tier: a server span carries
    ``meridian.tier``, its children hang off it."""
    servers = [
        s
        for s in spans
        if s.kind == SpanKind.SERVER and s.attributes and s.attributes.get(tm.TIER) == tier
    ]
    assert len(servers) == 1, [(s.name, s.kind, dict(s.attributes or {})) for s in spans]
    if kind == SpanKind.SERVER:
        return servers[0]
    found = [
        s
        for s in spans
        if _parent(s) == servers[0].context.span_id and s.kind == kind and s.name.startswith(name)
    ]
    assert len(found) == 1, [(s.name, s.kind, dict(s.attributes or {})) for s in spans]
    return found[0]


def _check_chain(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    """Server, decision and attempt span of each tier, linked into one chain."""
    by_id = {s.context.span_id: s for s in spans if s.context is not None}
    above: ReadableSpan | None = None
    out: dict[str, ReadableSpan] = {}
    for tier in ("global", "regional", "local"):
        server = _only(spans, tier, SpanKind.SERVER)
        pick = _only(spans, tier, SpanKind.INTERNAL, "pick")
        attempt = _only(spans, tier, SpanKind.CLIENT)
        if above is not None:
            assert _parent(server) == above.context.span_id
        assert _parent(pick) == server.context.span_id
        assert _parent(attempt) == server.context.span_id
        assert pick.end_time is not None and attempt.start_time is not None
        assert pick.end_time <= attempt.start_time
        assert (server.attributes or {})[tm.MODEL] == MODEL
        assert all(span.status.is_ok for span in (server, pick, attempt))
        assert pick.attributes is not None and attempt.attributes is not None
        # A request that waited in the queue was bound to a slot, not scored.
        queued = pick.attributes[tm.REASON] == "queue"
        assert pick.attributes[tm.CANDIDATES] >= (0 if queued else 1)
        assert pick.attributes[tm.CHILD] == attempt.attributes[tm.CHILD]
        assert attempt.attributes[tm.ATTEMPT] == 0
        assert attempt.attributes[tm.ACTUAL_S] > 0
        assert attempt.attributes[tm.STATUS] == grpc.StatusCode.OK.value[0]
        out[tier] = server
        out[f"{tier}.pick"] = pick
        out[f"{tier}.attempt"] = attempt
        above = attempt
    # Every span but the top one hangs off another span of this trace.
    orphans = [s for s in spans if s is not out["global"] and _parent(s) not in by_id]
    assert not orphans
    return out


async def test_one_trace_across_every_tier(chain: Chain) -> None:
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    call = chain.stub.ModelInfer(
        generate_request(MODEL, "hello tracing", 4),
        metadata=(("traceparent", traceparent), ("x-meridian-client-geo", "50,4")),
        timeout=10,
    )
    await call
    route = dict(await call.trailing_metadata())["x-meridian-route"]
    traces = chain.recent.traces()
    assert list(traces) == [CLIENT_TRACE]
    spans = traces[CLIENT_TRACE]
    links = _check_chain(spans)

    assert _hex(_parent(links["global"]) or 0) == CLIENT_SPAN
    region, zone, gpu = route.split("/")
    top = links["global"].attributes
    assert top is not None
    assert (top[tm.REGION], top[tm.ZONE], top[tm.GPU]) == (region, zone, gpu)
    assert top[tm.TENANT] == "anonymous"
    assert (links["global.pick"].attributes or {})[tm.REASON] == "nearest region"
    assert (links["regional.pick"].attributes or {})[tm.REASON] == "nearest zone"
    local_pick = links["local.pick"].attributes or {}
    assert local_pick[tm.REASON] == "least expected completion"
    assert local_pick[tm.POLICY] == "CompletionTimePicker"
    assert local_pick[tm.ESTIMATED_S] > 0
    local_attempt = links["local.attempt"].attributes or {}
    assert local_attempt[tm.CHILD] == gpu
    assert local_attempt[tm.ESTIMATED_S] == local_pick[tm.ESTIMATED_S]


async def test_a_request_without_traceparent_still_gets_one_trace(chain: Chain) -> None:
    call = chain.stub.ModelInfer(generate_request(MODEL, "no parent", 3), timeout=10)
    await call
    traces = chain.recent.traces()
    assert len(traces) == 1
    spans = next(iter(traces.values()))
    links = _check_chain(spans)
    assert links["global"].parent is None


async def test_a_stream_is_one_trace(chain: Chain) -> None:
    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        yield generate_request(MODEL, "stream me", 3, stream=True)

    call = chain.stub.ModelStreamInfer(requests(), timeout=10)
    responses = [r async for r in call]
    assert responses and not any(r.error_message for r in responses)
    traces = chain.recent.traces()
    assert len(traces) == 1
    spans = next(iter(traces.values()))
    links = _check_chain(spans)
    assert links["local"].name == "inference.GRPCInferenceService/ModelStreamInfer"


@pytest.mark.parametrize("max_concurrency", [1])
async def test_time_in_the_local_queue_is_a_span(chain: Chain) -> None:
    """Two GPUs of one slot each, three requests at once: one waits in the queue."""
    calls = [
        chain.stub.ModelInfer(generate_request(MODEL, f"queued {i}", 24), timeout=20)
        for i in range(3)
    ]
    await asyncio.gather(*calls)
    traces = chain.recent.traces()
    assert len(traces) == 3
    queued = [spans for spans in traces.values() if any(s.name == "queue" for s in spans)]
    assert len(queued) >= 1, [
        [(s.name, dict(s.attributes or {})) for s in t if s.name == "pick"] for t in traces.values()
    ]
    spans = queued[0]
    _check_chain(spans)
    pick = _only(spans, "local", SpanKind.INTERNAL, "pick")
    queue = next(s for s in spans if s.name == "queue")
    assert (pick.attributes or {})[tm.REASON] == "queue"
    assert _parent(queue) == pick.context.span_id
    assert queue.start_time is not None and queue.end_time is not None
    assert queue.end_time - queue.start_time > 0
