"""The endpoint picker behind a real Envoy: requests flow through Envoy to the GPU the
local tier chose, the fallback list replaces a killed GPU, refusals and bad input get
their exact status, and no GPU slot is left held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.request.routing import ROUTE
from common.request.v2 import generate_request
from local_lb.ext_proc_reply import SERVED
from tests.local_lb.envoy_stack import EnvoyZone, envoy_zone


@pytest.fixture
async def zone(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[EnvoyZone]:
    # Health checks 30 s apart: the tier learns of a killed GPU only from Envoy.
    async with envoy_zone(redis_server.url, tmp_path, health_interval_s=30.0) as z:
        await asyncio.sleep(0.3)  # the monitor's first (immediate) health checks
        yield z


async def _infer(z: EnvoyZone, prompt: str = "hello there", tokens: int = 3, **kw: object):  # type: ignore[no-untyped-def]
    call = z.stub.ModelInfer(generate_request("m", prompt, tokens), timeout=10, **kw)
    await call
    return call


async def _settled(z: EnvoyZone) -> None:
    """Every lease back: Envoy closes its ext_proc streams just after the response."""
    for _ in range(50):
        if z.slots_held() == 0:
            return
        await asyncio.sleep(0.02)
    assert z.slots_held() == 0, "a GPU slot is still held after every request ended"


async def test_requests_flow_through_envoy_to_the_chosen_gpu(zone: EnvoyZone) -> None:
    routes = set()
    for i in range(12):
        call = await _infer(zone, f"request {i}")
        routes.add(dict(await call.trailing_metadata())[ROUTE])
        # The served-endpoint header was for the picker; the caller never sees it.
        assert SERVED not in dict(await call.initial_metadata())
    assert routes <= {"g0", "g1"} and zone.served() == 12
    await _settled(zone)
    stats = await zone.envoy.stats("cluster.gpus.upstream_rq_total")
    assert stats["cluster.gpus.upstream_rq_total"] == 12  # Envoy carried every one


async def test_a_killed_gpu_is_replaced_by_the_fallback_list(zone: EnvoyZone) -> None:
    await zone.worker("g0").stop(0)
    served_before = zone.worker("g1").engine.requests_total
    for i in range(8):  # whichever GPU the picker names first, every request succeeds
        call = await _infer(zone, f"after the kill {i}")
        assert dict(await call.trailing_metadata())[ROUTE] == "g1"
    assert zone.worker("g1").engine.requests_total == served_before + 8
    dead = zone.gpu("g0")
    # Only Envoy's fallback can have told the tier (health checks are 30 s apart).
    assert not dead.healthy and "Envoy fell back" in dead.last_error
    retries = await zone.envoy.stats("cluster.gpus.upstream_rq_retry")
    assert retries.get("cluster.gpus.upstream_rq_retry", 0) >= 1
    await _settled(zone)


async def test_503_when_no_gpu_can_serve(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with envoy_zone(redis_server.url, tmp_path, health_interval_s=0.2) as z:
        for worker in z.workers:
            await worker.stop(0)
        for _ in range(50):  # the health monitor sees both go
            if not any(z.gpu(w.gpu.name).healthy for w in z.workers):
                break
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _infer(z)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "g0" in (err.value.details() or "")  # the picker's account, not Envoy's
        assert z.slots_held() == 0


async def test_429_with_retry_after_when_the_zone_sheds(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    # A request waits at most 10 ms for a slot: one that would take longer is shed.
    stack = envoy_zone(redis_server.url, tmp_path, gpus=1, max_concurrency=1, max_wait_s=0.01)
    async with stack as z:
        await asyncio.sleep(0.3)
        for _ in range(3):  # the zone learns its service time (nothing is shed before)
            await _infer(z, "warm up", 50)
        # Counted before the long request: the tier holds its slot a moment before the
        # GPU has taken it (a read at that moment missed it, under load).
        served = z.served()
        long = asyncio.ensure_future(_infer(z, "a long answer", 2000))
        for _ in range(100):  # the only slot is taken
            if z.slots_held() == 1:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            # 8000 tokens take several times the zone's typical service time: over 10 ms.
            await z.stub.ModelInfer(generate_request("m", "shed me", 8000), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(err.value.trailing_metadata() or ())["retry-after-ms"]) > 0
        await long
        assert z.served() == served + 1  # the long one; the shed one never reached the GPU
        await _settled(z)


@pytest.mark.parametrize(
    ("request_bytes", "metadata", "code", "words"),
    [
        (generate_request("", "no model", 3).SerializeToString(), (), "INVALID_ARGUMENT", "model"),
        (b"\xff\xff\xff garbage", (), "INVALID_ARGUMENT", "not a ModelInferRequest"),
        (generate_request("nope", "hi", 3).SerializeToString(), (), "NOT_FOUND", "nope"),
        (generate_request("m", "hi", 0).SerializeToString(), (), "INVALID_ARGUMENT", "max_tokens"),
        (
            generate_request("m", "hi", 3).SerializeToString(),
            (("x-meridian-priority", "urgent"),),
            "INVALID_ARGUMENT",
            "x-meridian-priority",
        ),
    ],
    ids=["no-model", "malformed-body", "unknown-model", "bad-max-tokens", "bad-hint"],
)
async def test_bad_grpc_input_gets_its_exact_status(
    zone: EnvoyZone, request_bytes: bytes, metadata: tuple, code: str, words: str
) -> None:
    raw = zone.channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(request_bytes, timeout=5, metadata=metadata)
    assert err.value.code().name == code
    assert words in (err.value.details() or "")
    assert zone.served() == 0 and zone.slots_held() == 0  # nothing ran, nothing held


async def test_stream_infer_is_refused_with_unimplemented(zone: EnvoyZone) -> None:
    call = zone.stub.ModelStreamInfer(timeout=5)
    await call.write(generate_request("m", "stream me", 3))
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert zone.served() == 0


async def test_a_caller_that_gives_up_frees_its_slot(zone: EnvoyZone) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await zone.stub.ModelInfer(generate_request("m", "long", 2000), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _settled(zone)  # Envoy reset the stream; the picker's lease went with it
