"""Bad input at the OpenAI edge gets its exact status in OpenAI's error shape and loses
nothing; a client that goes away mid-request cancels it down to the GPU, frees its
slots and leaves its usage record (issue 13, item 1)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from common.basics.redis_embed import EmbeddedRedis
from tests.e2e.openai_chain import EDGES, MODEL, Chain, openai_chain

CHAT = "/chat/completions"
COMPLETIONS = "/completions"
GOOD = {"model": MODEL, "prompt": "tell me about routers", "max_tokens": 2}


@pytest.fixture(params=EDGES)
async def chain(
    redis_server: EmbeddedRedis, request: pytest.FixtureRequest
) -> AsyncIterator[Chain]:
    async with openai_chain(redis_server.url, edge=request.param) as running:
        yield running


async def post(
    chain: Chain, path: str, body: bytes | Any, tenant: str | None = "gold"
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(chain.auth(tenant) if tenant else {})}
    async with aiohttp.ClientSession() as session:
        async with session.post(chain.base_url + path, data=data, headers=headers) as reply:
            return reply.status, await reply.json()


def error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        pytest.param(COMPLETIONS, b'{"model": "m", "prompt": ', None, "not valid JSON", id="json"),
        pytest.param(COMPLETIONS, b"\xff\xfe{}", None, "not valid JSON", id="not-utf8"),
        pytest.param(COMPLETIONS, [GOOD], None, "JSON object", id="array"),
        pytest.param(COMPLETIONS, {"prompt": "x"}, "model", "'model' is required", id="no-model"),
        pytest.param(COMPLETIONS, {**GOOD, "max_tokens": "ten"}, "max_tokens", "integer", id="str"),
        pytest.param(COMPLETIONS, {**GOOD, "max_tokens": 9000}, "max_tokens", "8192", id="big"),
        pytest.param(COMPLETIONS, {**GOOD, "stream": "yes"}, "stream", "true or false", id="s"),
        pytest.param(COMPLETIONS, {**GOOD, "prompt": 7}, "prompt", "string", id="prompt"),
        pytest.param(CHAT, {"model": MODEL}, "messages", "'messages' is required", id="none"),
        pytest.param(CHAT, {"model": MODEL, "messages": "hi"}, "messages", "list", id="msgs"),
        pytest.param(
            CHAT,
            {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "'robot'",
            id="role",
        ),
    ],
)
async def test_a_bad_body_is_400_naming_the_field_and_reaches_no_gpu(
    chain: Chain, path: str, body: Any, param: str | None, says: str
) -> None:
    status, reply = await post(chain, path, body)
    err = error(reply)
    assert (status, err["type"], err["code"], err["param"]) == (
        400,
        "invalid_request_error",
        "invalid_argument",
        param,
    )
    assert says in err["message"]
    assert chain.served() == 0
    status, good = await post(chain, COMPLETIONS, GOOD)
    assert status == 200 and good["usage"]["completion_tokens"] == 2


async def test_a_bad_key_is_refused_before_the_body_is_read(chain: Chain) -> None:
    status, reply = await post(chain, COMPLETIONS, b"not json", tenant=None)
    assert (status, error(reply)["code"]) == (401, "unauthenticated")
    assert "authorization" in error(reply)["message"]


async def test_an_oversized_body_is_413(chain: Chain) -> None:
    huge = {**GOOD, "prompt": "x" * (2 * 1024 * 1024 + 1)}  # over max_message_bytes / 2
    status, reply = await post(chain, COMPLETIONS, huge)
    assert (status, error(reply)["code"]) == (413, "request_too_large")
    # Under the body limit but over limits.max_prompt_bytes: the V2 path's own 400.
    status, reply = await post(chain, COMPLETIONS, {**GOOD, "prompt": "x" * (300 * 1024)})
    assert (status, error(reply)["code"]) == (400, "invalid_argument")
    assert "max_prompt_bytes" in error(reply)["message"]
    assert chain.served() == 0


async def test_unknown_paths_and_methods_answer_in_openai_shape(chain: Chain) -> None:
    async with aiohttp.ClientSession(headers=chain.auth("gold")) as session:
        async with session.post(chain.base_url + "/embeddings", json={}) as reply:
            assert (reply.status, error(await reply.json())["code"]) == (404, "not_found")
        async with session.get(chain.base_url + COMPLETIONS) as reply:
            assert reply.status == 405
            assert error(await reply.json())["code"] == "method_not_allowed"


@pytest.mark.parametrize("edge", EDGES)
async def test_a_client_gone_mid_stream_cancels_its_request_down_to_the_gpu(
    redis_server: EmbeddedRedis, edge: str
) -> None:
    # Real-time GPUs: 4000 tokens take ~20 s, so only a cancellation ends it soon.
    async with openai_chain(redis_server.url, time_scale=1.0, edge=edge) as chain:
        body = {**GOOD, "max_tokens": 4000, "stream": True}
        async with aiohttp.ClientSession(headers=chain.auth("solo")) as session:
            async with session.post(chain.base_url + COMPLETIONS, json=body) as reply:
                assert reply.status == 200
                assert reply.headers["Content-Type"].startswith("text/event-stream")
                events = 0
                async for line in reply.content:
                    events += line.startswith(b"data: {")
                    if events == 3:
                        break
                assert chain.running() == 1
                reply.close()  # the client goes away
        await chain.wait_idle(timeout_s=3)
        (record,) = await chain.wait_usage("solo", 1)
        assert record.status == "CANCELLED" and 3 <= record.completion_tokens < 4000
        # Its concurrency slot (max_concurrent: 1) is back: the next request runs at once.
        status, again = await post(chain, COMPLETIONS, GOOD, tenant="solo")
        assert status == 200 and again["choices"][0]["text"]


@pytest.mark.parametrize("edge", EDGES)
async def test_a_client_gone_before_a_unary_answer_cancels_it_too(
    redis_server: EmbeddedRedis, edge: str
) -> None:
    async with openai_chain(redis_server.url, time_scale=1.0, edge=edge) as chain:
        body = {**GOOD, "max_tokens": 4000}
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(headers=chain.auth("solo"), timeout=timeout) as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(chain.base_url + COMPLETIONS, json=body)
        await chain.wait_idle(timeout_s=3)
        (record,) = await chain.wait_usage("solo", 1)
        assert record.status == "CANCELLED"
        status, _ = await post(chain, COMPLETIONS, GOOD, tenant="solo")
        assert status == 200
