"""A live tier's /metrics: the LLM latencies a real call produces, content negotiation
(text 0.0.4, or OpenMetrics with the trace id as exemplar), and `promtool check metrics`.

The tier is a real ``TierServer`` over a real child V2 server on loopback that streams
its tokens with a set delay before the first and between the others, so time to first
token and time per output token have known values to be measured against."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest
from opentelemetry.trace import SpanKind
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability import tracing as tm
from common.observability.trace_names import span_name
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.server import V2Server
from common.request.v2 import generate_request, text_response
from common.tier.server import TierServer
from tests.common.observability.test_metrics import OPENMETRICS, parse
from tests.common.request.front import InOrder

MODEL = "demo-llm"
FIRST_S = 0.15  # before the first token
GAP_S = 0.03  # between tokens
TOKENS = 6


class PacedTokens(pb_grpc.GRPCInferenceServiceServicer):
    """A child that answers after FIRST_S, and streams TOKENS tokens GAP_S apart."""

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        await asyncio.sleep(FIRST_S)
        return text_response(request, "whole answer")

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        async for request in requests:
            await asyncio.sleep(FIRST_S)
            for i in range(TOKENS):
                if i:
                    await asyncio.sleep(GAP_S)
                response = text_response(request, f"t{i}", final=i == TOKENS - 1)
                await context.write(pb.ModelStreamInferResponse(infer_response=response))


@dataclass
class Live:
    tier: TierServer
    stub: pb_grpc.GRPCInferenceServiceStub
    telemetry: tm.Telemetry

    async def scrape(self, accept: str | None = None) -> tuple[str, str]:
        assert self.tier.ops_server is not None
        url = f"http://{self.tier.ops_server.address}/metrics"
        headers = {"Accept": accept} if accept else {}
        async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as r:
            assert r.status == 200
            return r.headers["Content-Type"], await r.text()


@pytest.fixture
async def live(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Live]:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    for name in ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    telemetry = tm.setup_tracing("test-metrics")
    child = V2Server(PacedTokens(), Endpoint("127.0.0.1", 0))
    await child.start()
    children = ChildSet(
        [Child("us-east", Endpoint("127.0.0.1", child.port), frozenset({MODEL}))],
        probe_interval_s=1,
        summary_ttl_s=1,
        probe=False,
    )
    tier = TierServer(
        TierSpec(tier="global", trust_internal=False, resolve_origin=lambda hints: None),
        ForwardingPolicy(kind="region"),
        children,
        RankingBalancer(InOrder(), children),
        Endpoint("127.0.0.1", 0),
        ops=Endpoint("127.0.0.1", 0),
        telemetry=telemetry,
    )
    await tier.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{tier.port}")
    try:
        yield Live(tier, pb_grpc.GRPCInferenceServiceStub(channel), telemetry)
    finally:
        await channel.close()
        await tier.stop(0)
        await child.stop(0)


def histogram(text: str, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram over all its label sets, from text 0.0.4."""
    samples = parse(text)
    count = sum(v for n, _, v in samples if n == f"{name}_count")
    total = sum(v for n, _, v in samples if n == f"{name}_sum")
    return count, total


async def test_a_unary_call_counts_its_latency_as_its_time_to_first_token(live: Live) -> None:
    await live.stub.ModelInfer(generate_request(MODEL, "hello", 4), timeout=5)
    content_type, text = await live.scrape()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    count, latency = histogram(text, "meridian_request_duration_seconds")
    ttft_count, ttft = histogram(text, "meridian_time_to_first_token_seconds")
    assert count == ttft_count == 1
    assert FIRST_S <= ttft <= latency
    assert latency - ttft < 0.01  # a unary answer is its first and last response
    assert histogram(text, "meridian_time_per_output_token_seconds") == (0, 0)
    decisions = [(ls["reason"], v) for n, ls, v in parse(text) if n == "meridian_decisions_total"]
    assert decisions == [("ranked", 1.0)]


async def test_a_streamed_request_has_time_to_first_token_and_per_output_token(
    live: Live,
) -> None:
    request = generate_request(MODEL, "hello", TOKENS, request_id="s", stream=True)
    responses = [r async for r in live.stub.ModelStreamInfer(iter([request]), timeout=5)]
    assert len(responses) == TOKENS
    _, text = await live.scrape()
    count, latency = histogram(text, "meridian_request_duration_seconds")
    _, ttft = histogram(text, "meridian_time_to_first_token_seconds")
    tpot_count, tpot = histogram(text, "meridian_time_per_output_token_seconds")
    assert count == tpot_count == 1
    # The first token, not the whole answer: the tokens after it took (TOKENS - 1) × GAP_S
    # at least. Bounds on differences, as the test's loop may stall (a busy machine) and
    # delay the first token's arrival by as much as the margin here (half of that).
    assert FIRST_S <= ttft <= latency - (TOKENS - 1) * GAP_S / 2
    assert latency >= FIRST_S + (TOKENS - 1) * GAP_S
    assert GAP_S / 2 <= tpot < GAP_S * 3
    generated = [v for n, _, v in parse(text) if n == "meridian_generation_tokens_total"]
    assert generated == [TOKENS]


async def test_openmetrics_carries_the_trace_id_of_the_call_as_exemplar(live: Live) -> None:
    await live.stub.ModelInfer(generate_request(MODEL, "hello", 4), timeout=5)
    assert live.telemetry.recent is not None
    # The server span (the client span to the child bears the same conventional name).
    name, server = span_name("ModelInfer"), SpanKind.SERVER
    [span] = [s for s in live.telemetry.recent.spans() if s.name == name and s.kind == server]
    trace_id = format(span.get_span_context().trace_id, "032x")
    content_type, text = await live.scrape(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    exemplars = {
        family.name: sample.exemplar.labels["trace_id"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.exemplar is not None
    }
    assert exemplars == {
        "meridian_request_duration_seconds": trace_id,
        "meridian_time_to_first_token_seconds": trace_id,
    }
    _, plain = await live.scrape()
    assert trace_id not in plain


def promtool(body: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make promtool`)")
    return subprocess.run(
        [tool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30
    )


async def test_promtool_finds_nothing_to_complain_about(live: Live) -> None:
    await live.stub.ModelInfer(generate_request(MODEL, "hello", 4), timeout=5)
    request = generate_request(MODEL, "hello", TOKENS, request_id="s", stream=True)
    _ = [r async for r in live.stub.ModelStreamInfer(iter([request]), timeout=5)]
    with pytest.raises(grpc.aio.AioRpcError):
        await live.stub.ModelInfer(generate_request("no-such-model", "hello"), timeout=5)
    # promtool reads the text format only; the OpenMetrics rendering is checked by
    # the strict OpenMetrics parser in the exemplar test.
    _, text = await live.scrape()
    done = promtool(text)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (
        done.stdout + done.stderr
    )
