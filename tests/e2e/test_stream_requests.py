"""Every request of a stream counts, through global → regional → local → GPU in-process:
each is admitted on its own against the tenant's limits (rate, tokens, concurrency),
never more run at once than the tenant may, and each leaves a usage record of its own
with its own token counts (issue 16, items 1 and 2)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import redis

from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability import tracing as tm
from common.request.v2 import STREAM, generate_request
from common.tenancy.auth import hash_key
from common.tenancy.usage import USAGE_STREAM, UsageRecord
from common.tier.server import TierServer
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers
from tests.e2e.chain import running_chain

REGION, ZONE, MODEL = "eu", "eu-1a", "m"
PROMPT = "tell me about routers"  # 4 prompt tokens (whitespace words)


@dataclass
class Fleet:
    stub: pb_grpc.GRPCInferenceServiceStub
    workers: ZoneWorkers
    keys: dict[str, str]  # tenant name -> API key
    ids: dict[str, str]  # tenant name -> tenant id (fresh per test: rate limits live in Redis)
    redis_url: str
    recent: tm.RecentSpans

    def auth(self, tenant: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.keys[tenant]}")]

    def running(self) -> list[int]:
        return [gpu.engine.running for gpu in self.workers]


TENANTS: dict[str, dict[str, Any]] = {
    # The demo fleet's free tier: 3 requests/s (burst 3), 30k tokens/min (burst 5000), 4 at once.
    "free": {"requests_per_s": 3, "tokens_per_min": 30000, "max_concurrent": 4},
    "narrow": {"max_concurrent": 2},
    "open": {},
}


def _mapping(redis_url: str, ids: dict[str, str], keys: dict[str, str]) -> dict[str, Any]:
    tenants = [
        {"id": ids[name], "api_key_sha256": [hash_key(keys[name])], **limits}
        for name, limits in TENANTS.items()
    ]
    return one_zone_mapping(
        redis_url,
        model=MODEL,
        gpus=2,
        region=REGION,
        zone=ZONE,
        global_listen=f"127.0.0.1:{free_port()}",
        region_listen=f"127.0.0.1:{free_port()}",
        # Probes time out after one interval: 2 s keeps a busy loop from failing them.
        health_interval_s=2.0,
        slow_start_window_s=0,
        auth={"enabled": True, "tenants": tenants},
    )


@pytest.fixture
async def fleet(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Fleet]:
    for name in ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    telemetry = tm.setup_tracing("meridian-test")
    assert telemetry.recent is not None
    suffix = uuid.uuid4().hex[:8]
    ids = {name: f"{name}-{suffix}" for name in TENANTS}
    keys = {name: f"mk_{name}_{suffix}" for name in TENANTS}
    topo = topology_from_mapping(_mapping(redis_server.url, ids, keys))
    workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=0.05)
    tiers: list[TierServer] = [
        build_local_tier(topo, REGION, ZONE, telemetry=telemetry),
        build_regional_tier(topo, REGION, telemetry=telemetry),
        build_global_tier(topo, telemetry=telemetry),
    ]
    try:
        async with running_chain(topo, workers, tiers, MODEL) as stub:
            telemetry.recent.clear()
            yield Fleet(stub, workers, keys, ids, redis_server.url, telemetry.recent)
    finally:
        telemetry.shutdown()


@contextlib.asynccontextmanager
async def peak(sample: Callable[[], int]) -> AsyncIterator[list[int]]:
    """``[highest value of sample()]`` seen while the block ran (sampled every 2 ms)."""
    high = [sample()]

    async def watch() -> None:
        while True:
            high[0] = max(high[0], sample())
            await asyncio.sleep(0.002)

    task = asyncio.create_task(watch())
    try:
        yield high
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run_stream(
    fleet: Fleet, tenant: str, requests: Sequence[pb.ModelInferRequest]
) -> dict[str, list[pb.ModelStreamInferResponse]]:
    """Send ``requests`` on one stream; the responses by request id (errors by the id
    their message names)."""
    call: Any = fleet.stub.ModelStreamInfer(iter(requests), metadata=fleet.auth(tenant), timeout=30)
    by_id: dict[str, list[pb.ModelStreamInferResponse]] = defaultdict(list)
    async for response in call:
        if response.error_message:
            by_id[response.error_message.rpartition("(request id '")[2].rstrip("')")].append(
                response
            )
        else:
            by_id[response.infer_response.id].append(response)
    assert await call.code() == grpc.StatusCode.OK
    return by_id


def tokens_of(responses: list[pb.ModelStreamInferResponse]) -> int:
    """The tokens a request's responses carry, as the GPU counted them (its last
    response's total): fewer responses than tokens once a tier coalesced them."""
    return responses[-1].infer_response.parameters["completion_tokens"].int64_param


def usage_of(redis_url: str, tenant_id: str) -> list[UsageRecord]:
    client = redis.Redis.from_url(redis_url)
    try:
        entries: Any = client.xrange(USAGE_STREAM)
    finally:
        client.close()
    records = [UsageRecord.from_fields(fields) for _, fields in entries]
    return [r for r in records if r.tenant == tenant_id]


async def wait_for_usage(fleet: Fleet, tenant: str, count: int) -> list[UsageRecord]:
    """The tenant's usage records once ``count`` arrived (the edge flushes every 0.1 s)."""
    deadline = time.monotonic() + 5
    while True:
        records = usage_of(fleet.redis_url, fleet.ids[tenant])
        if len(records) >= count or time.monotonic() > deadline:
            return records
        await asyncio.sleep(0.05)


def streamed(count: int, max_tokens: int) -> Iterator[pb.ModelInferRequest]:
    for i in range(count):
        yield generate_request(MODEL, PROMPT, max_tokens, request_id=f"r{i}", stream=True)


async def test_a_free_tier_stream_is_admitted_request_by_request(fleet: Fleet) -> None:
    """20 requests x 600 tokens on one stream: the rate limit (burst 3) admits a few,
    the rest are refused one by one, never more than max_concurrent (4) run at once,
    and each request leaves its own usage record."""
    started = time.monotonic()
    async with peak(lambda: sum(fleet.running())) as running:
        by_id = await run_stream(fleet, "free", list(streamed(20, 600)))
    elapsed_s = time.monotonic() - started
    assert sorted(by_id) == sorted(f"r{i}" for i in range(20))  # every request answered
    served = {i for i, rs in by_id.items() if not rs[0].error_message}
    refused = set(by_id) - served
    for request_id in served:
        assert tokens_of(by_id[request_id]) == 600
    for request_id in refused:
        [error] = by_id[request_id]
        assert error.error_message.startswith("RESOURCE_EXHAUSTED: ")
    # GCRA admits at most its burst (3) plus 3 a second; the rest are refused, not queued.
    assert 3 <= len(served) <= 3 + 3 * elapsed_s and refused
    assert running[0] <= 4
    records = await wait_for_usage(fleet, "free", 20)
    assert len(records) == 20
    ok = [r for r in records if r.status == "OK"]
    assert len(ok) == len(served)
    assert {(r.prompt_tokens, r.completion_tokens) for r in ok} == {(4, 600)}
    assert {(r.status, r.completion_tokens) for r in records if r not in ok} == {
        ("RESOURCE_EXHAUSTED", 0)
    }
    assert all(r.gpu for r in ok) and not any(r.gpu for r in records if r not in ok)


async def test_a_stream_never_runs_more_than_the_tenants_max_concurrent(fleet: Fleet) -> None:
    async with peak(lambda: sum(fleet.running())) as running:
        by_id = await run_stream(fleet, "narrow", list(streamed(6, 400)))
    assert running[0] <= 2
    served = [i for i, rs in by_id.items() if not rs[0].error_message]
    assert len(served) >= 2 and all(tokens_of(by_id[i]) == 400 for i in served)
    for request_id in set(by_id) - set(served):
        assert by_id[request_id][0].error_message.startswith("RESOURCE_EXHAUSTED: ")
    assert len(await wait_for_usage(fleet, "narrow", 6)) == 6


async def test_stream_false_is_billed_its_max_tokens_and_a_streamed_one_its_tokens(
    fleet: Fleet,
) -> None:
    whole = generate_request(MODEL, PROMPT, 100, request_id="whole")
    whole.parameters[STREAM].bool_param = False
    tokens = generate_request(MODEL, PROMPT, 37, request_id="tokens", stream=True)
    by_id = await run_stream(fleet, "open", [whole, tokens])
    assert (len(by_id["whole"]), tokens_of(by_id["tokens"])) == (1, 37)
    records = await wait_for_usage(fleet, "open", 2)
    assert sorted((r.completion_tokens, r.prompt_tokens, r.status) for r in records) == [
        (37, 4, "OK"),
        (100, 4, "OK"),
    ]
    # One trace for the stream, its requests' decisions under the stream's span.
    [spans] = fleet.recent.traces().values()
    [server] = [s for s in spans if s.name == tm.span_name("ModelStreamInfer") and s.parent is None]
    picks = [s for s in spans if s.name == "pick" and s.parent == server.context]
    assert len(picks) == 2
