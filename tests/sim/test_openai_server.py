"""The emulated GPU's OpenAI side (sim.openai_server), called by the stock openai client."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from common.basics.redis_embed import free_port
from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from local_lb.load_book import parse_prometheus_load
from sim.worker import GpuWorker


def openai_gpu(name: str = "gpu-o", kv_cache_tokens: int = 4096) -> GpuConfig:
    where = Endpoint("127.0.0.1", 0)
    return GpuConfig(
        name=name,
        endpoint=where,
        metrics_endpoint=where,  # vLLM's: /metrics on the API port
        hardware="A100",
        models=("llama",),
        kv_cache_tokens=kv_cache_tokens,
        protocol="openai",
    )


@pytest.fixture
async def worker() -> AsyncIterator[GpuWorker]:
    w = GpuWorker(openai_gpu(), region="eu", zone="eu-a", time_scale=0.05)
    await w.start()
    try:
        yield w
    finally:
        await w.stop(0)
    # Every request ended (finished, failed or cancelled) must have released its KV.
    assert (w.engine.running, w.engine.waiting, w.engine.kv_cache_usage) == (0, 0, 0.0)


@pytest.fixture
async def client(worker: GpuWorker) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{worker.port}/v1", api_key="unused", max_retries=0
    ) as c:
        yield c
    # httpx resolves even a numeric host in the loop's default executor: end its thread.
    await asyncio.get_running_loop().shutdown_default_executor()


async def test_completions_unary_with_usage(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(model="llama", prompt="one two three", max_tokens=5)
    assert len(answer.choices[0].text.split()) == 5
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 5)


async def test_completions_streamed_one_chunk_per_token_then_usage(
    client: openai.AsyncOpenAI,
) -> None:
    stream = await client.completions.create(
        model="llama",
        prompt="a b",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 4 and len("".join(texts).split()) == 4
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == 2


async def test_chat_unary_and_streamed(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    answer = await client.chat.completions.create(model="llama", messages=messages, max_tokens=3)
    assert answer.choices[0].message.content is not None
    assert len(answer.choices[0].message.content.split()) == 3
    assert answer.usage is not None and answer.usage.prompt_tokens == 3  # "user: hello there"
    stream = await client.chat.completions.create(
        model="llama", messages=messages, max_tokens=3, stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert len("".join(p or "" for p in pieces).split()) == 3


async def test_chat_reads_max_completion_tokens(client: openai.AsyncOpenAI) -> None:
    """OpenAI's newer name for a chat's cap, which vLLM reads and SMG and sglang-router
    send in place of max_tokens: the answer stops at it, not at the default length."""
    messages = [{"role": "user", "content": "hello there"}]
    answer = await client.chat.completions.create(
        model="llama", messages=messages, max_completion_tokens=5
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 5


async def test_models_health_and_metrics_on_the_api_port(
    worker: GpuWorker, client: openai.AsyncOpenAI
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["llama"]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{worker.port}/health") as r:
            assert r.status == 200
        async with http.get(f"http://127.0.0.1:{worker.port}/metrics") as r:
            text = await r.text()
    assert "vllm:num_requests_running" in text
    assert parse_prometheus_load(text) == (0.0, 0.0, 0.0)


async def test_bad_requests_get_openai_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "nope" in missing.value.message
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="llama", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):  # more than the KV cache holds
        await client.completions.create(model="llama", prompt="x " * 5000, max_tokens=8)


async def test_malformed_json_body_is_400(worker: GpuWorker) -> None:
    url = f"http://127.0.0.1:{worker.port}/v1/completions"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=b"{oops", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert "not JSON" in (await r.json())["error"]["message"]


async def test_a_client_that_disconnects_mid_stream_stops_its_generation(
    worker: GpuWorker,
) -> None:
    url = f"http://127.0.0.1:{worker.port}/v1/completions"
    body = {"model": "llama", "prompt": "long", "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body) as r:
            await r.content.readline()  # the first chunk: it is generating
            assert worker.engine.running == 1
    for _ in range(100):  # the connection is gone: the handler is cancelled, KV freed
        if worker.engine.running == 0:
            break
        await asyncio.sleep(0.02)
    assert worker.engine.running == 0
    assert worker.engine.tokens_generated_total < 2000


async def test_a_stopped_gpu_is_not_healthy_and_refuses() -> None:
    w = GpuWorker(openai_gpu(), region="eu", zone="eu-a", time_scale=0.05)
    await w.start()
    port = w.port
    await w.stop(0)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(f"http://127.0.0.1:{port}/health"):
                pass


async def test_a_separate_metrics_port_when_the_entry_names_one() -> None:
    gpu = dataclasses.replace(openai_gpu(), metrics_endpoint=Endpoint("127.0.0.1", free_port()))
    w = GpuWorker(gpu, region="eu", zone="eu-a", time_scale=0.05)
    await w.start()
    try:
        assert w.metrics_port != w.port
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{w.metrics_port}/metrics") as r:
                assert "vllm:" in await r.text()
    finally:
        await w.stop(0)
