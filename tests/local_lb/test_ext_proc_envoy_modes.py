"""The endpoint picker behind a real Envoy, other shapes: an ORIGINAL_DST cluster (one
address in the header), the data plane's subset hint, and OpenAI HTTP callers' bad
input (answered by the picker before any GPU is involved)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.config.node import Endpoint
from common.request.routing import ROUTE
from common.request.v2 import generate_request
from tests.local_lb.envoy_stack import EnvoyZone, envoy_zone


async def _route(z: EnvoyZone, prompt: str) -> str:
    call = z.stub.ModelInfer(generate_request("m", prompt, 3), timeout=10)
    await call
    return dict(await call.trailing_metadata())[ROUTE]


async def test_original_dst_cluster_serves_the_one_endpoint_named(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """ORIGINAL_DST reads one address: the picker names only the chosen GPU; a killed
    GPU costs the request that was sent to it (no list to fall back on), after which
    the tier, told by Envoy's answer, sends no more there."""
    stack = envoy_zone(
        redis_server.url, tmp_path, original_dst=True, fallbacks=0, health_interval_s=30.0
    )
    async with stack as z:
        await asyncio.sleep(0.3)
        assert {await _route(z, f"req {i}") for i in range(8)} <= {"g0", "g1"}
        assert z.served() == 8 and z.slots_held() == 0
        await z.worker("g0").stop(0)
        failed = 0
        for i in range(10):
            try:
                assert await _route(z, f"after {i}") == "g1"
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                failed += 1
        assert failed <= 1 and not z.gpu("g0").healthy
        for _ in range(50):
            if z.slots_held() == 0:
                break
            await asyncio.sleep(0.02)
        assert z.slots_held() == 0


async def test_subset_hint_limits_the_choice(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with envoy_zone(redis_server.url, tmp_path, gpus=3, subset_gpus=["g2"]) as z:
        await asyncio.sleep(0.3)
        assert {await _route(z, f"req {i}") for i in range(8)} == {"g2"}


async def test_subset_hint_naming_no_gpu_is_503(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    elsewhere = [Endpoint("127.0.0.1", 9)]
    async with envoy_zone(redis_server.url, tmp_path, subset=elsewhere) as z:
        await asyncio.sleep(0.3)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _route(z, "nowhere to go")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "subset hint" in (err.value.details() or "")
        assert z.served() == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b'{"prompt": "hi"}', 400, "'model' is required"),
        ("/v1/completions", b'{"model": 7, "prompt": "hi"}', 400, "'model' is required"),
        (
            "/v1/completions",
            b'{"model": "m", "prompt": "hi", "max_tokens": "t"}',
            400,
            "max_tokens",
        ),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', 400, "messages"),
        ("/v1/completions", b'{"model": "nope", "prompt": "hi"}', 404, "nope"),
        ("/v1/embeddings", b'{"model": "m"}', 404, "no route"),
    ],
    ids=["malformed", "no-model", "model-type", "max-tokens-type", "messages", "unknown", "route"],
)
async def test_openai_bad_input_gets_its_status_in_openai_shape(
    redis_server: EmbeddedRedis, tmp_path: Path, path: str, body: bytes, status: int, words: str
) -> None:
    async with envoy_zone(redis_server.url, tmp_path) as z:
        url = f"http://{z.listen.address}{path}"
        headers = {"content-type": "application/json"}
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=body, headers=headers) as answer:
                assert answer.status == status
                assert answer.headers["content-type"] == "application/json"
                error = json.loads(await answer.read())["error"]
        assert words in error["message"] and error["code"]
        assert z.served() == 0 and z.slots_held() == 0


async def test_openai_caller_shed_gets_429_with_retry_after(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    stack = envoy_zone(redis_server.url, tmp_path, gpus=1, max_concurrency=1, max_wait_s=0.01)
    async with stack as z:
        await asyncio.sleep(0.3)
        for _ in range(3):  # the zone learns its service time (nothing is shed before)
            await z.stub.ModelInfer(generate_request("m", "warm up", 20), timeout=10)
        long = asyncio.ensure_future(
            z.stub.ModelInfer(generate_request("m", "a long answer", 2000), timeout=10)
        )
        for _ in range(100):
            if z.slots_held() == 1:
                break
            await asyncio.sleep(0.01)
        body = json.dumps({"model": "m", "prompt": "shed me", "max_tokens": 8000})
        url = f"http://{z.listen.address}/v1/completions"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=body) as answer:
                assert answer.status == 429
                assert int(answer.headers["Retry-After"]) >= 1
                assert int(answer.headers["retry-after-ms"]) > 0
                assert json.loads(await answer.read())["error"]["type"] == "rate_limit_error"
        await long


async def test_picker_unreachable_is_503(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with envoy_zone(redis_server.url, tmp_path) as z:
        await z.picker.stop()  # Envoy's ext_proc filter cannot reach it: status_on_error
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _route(z, "no picker")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert z.served() == 0
