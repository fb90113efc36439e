"""The endpoint picker behind a real Envoy in front of OpenAI HTTP GPUs (vLLM's API over
HTTP/1.1): SSE streams and unary answers flow through Envoy, and the picker learns
each request's end from the close of its ext_proc stream (an HTTP/1.1 response has no
trailers, and the response body never goes through the picker): the lease comes back
as OK when the response ends, after its time, and a caller gone mid-stream frees it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from common.basics.redis_embed import EmbeddedRedis
from local_lb.balancer import LocalBalancer
from local_lb.state import GpuChild
from tests.local_lb.envoy_stack import EnvoyZone, envoy_zone


@pytest.fixture
async def zone(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[EnvoyZone]:
    async with envoy_zone(redis_server.url, tmp_path, openai=True, health_interval_s=5.0) as z:
        await asyncio.sleep(0.3)  # the monitor's first (immediate) health checks
        yield z


def _balancer(z: EnvoyZone) -> LocalBalancer:
    return z.picker.picker.balancer


def _url(z: EnvoyZone) -> str:
    return f"http://{z.listen.address}/v1/completions"


async def _settled(z: EnvoyZone) -> None:
    for _ in range(100):
        if z.slots_held() == 0:
            return
        await asyncio.sleep(0.02)
    assert z.slots_held() == 0, "a GPU slot is still held after every request ended"


def _served(z: EnvoyZone) -> list[GpuChild]:
    return [z.gpu(w.gpu.name) for w in z.workers if w.engine.requests_total]


async def test_an_sse_stream_is_released_ok_when_it_ends(zone: EnvoyZone) -> None:
    doc = {"model": "m", "prompt": "tell me a story", "max_tokens": 1500, "stream": True}
    began = time.monotonic()
    events: list[bytes] = []
    async with aiohttp.ClientSession() as http, http.post(_url(zone), json=doc) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        headed = time.monotonic()  # the lease was taken before the response began
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    ended = time.monotonic()
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if b'"choices"' in e)
    assert text  # every token came through Envoy
    await _settled(zone)
    (gpu,) = _served(zone)
    # Released as OK, at the end of the stream: the GPU's latency and the zone's service
    # time were learned from it, and last at least as long as the body did (a release at
    # the response headers would be shorter), at most the whole call.
    assert ended - headed > 0.1  # 1500 tokens take a while, even emulated
    assert ended - headed <= gpu.latency_ewma_s <= ended - began + 0.1
    assert _balancer(zone).rates.service_s == gpu.latency_ewma_s
    assert gpu.healthy and zone.served() == 1


async def test_a_unary_answer_is_released_ok(zone: EnvoyZone) -> None:
    doc = {"model": "m", "prompt": "hello", "max_tokens": 8}
    async with aiohttp.ClientSession() as http, http.post(_url(zone), json=doc) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["usage"]["completion_tokens"] == 8
    await _settled(zone)
    (gpu,) = _served(zone)
    assert gpu.latency_ewma_s > 0 and _balancer(zone).rates.service_s > 0


async def test_a_caller_gone_mid_stream_frees_its_slot(zone: EnvoyZone) -> None:
    doc = {"model": "m", "prompt": "a long one", "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(_url(zone), json=doc)
        assert resp.status == 200
        await resp.content.readline()
        assert zone.slots_held() == 1
        resp.close()  # the caller goes away; Envoy resets the GPU's request
    await _settled(zone)


def test_openai_gpus_are_dialled_over_http1_and_no_body_goes_to_the_picker() -> None:
    from common.config.node import Endpoint
    from local_lb.ext_proc_envoy import HTTP_OPTIONS, envoy_bootstrap

    ends = [Endpoint("127.0.0.1", 1)]
    one = ends[0]
    boot = envoy_bootstrap(listen=one, picker=one, admin=one, gpus=ends, openai_gpus=True)
    gpus = boot["static_resources"]["clusters"][1]
    assert gpus["typed_extension_protocol_options"][HTTP_OPTIONS]["explicit_http_config"] == {
        "http_protocol_options": {}
    }
    manager = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = [
        f for f in manager["typed_config"]["http_filters"] if f["name"].endswith("ext_proc")
    ]
    mode = ext_proc["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == "BUFFERED"  # the model and prompt
    assert mode["response_body_mode"] == "NONE"  # never a token
    assert mode["response_trailer_mode"] == "SKIP"  # HTTP/1.1 answers have none
