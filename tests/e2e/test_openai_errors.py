"""Every error status of the OpenAI edge, in OpenAI's JSON shape, through a real chain:
the stock client's exception for each, and nothing lost (issue 13, item 1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from common.basics.redis_embed import EmbeddedRedis
from tests.e2e.openai_chain import EDGES, MODEL, Chain, openai_chain

PROMPT = "tell me about routers"


@pytest.fixture(params=EDGES)
async def chain(
    redis_server: EmbeddedRedis, request: pytest.FixtureRequest
) -> AsyncIterator[Chain]:
    async with openai_chain(redis_server.url, edge=request.param) as running:
        yield running


def error_of(err: openai.APIStatusError) -> dict[str, Any]:
    assert isinstance(err.body, dict)
    assert set(err.body) == {"message", "type", "param", "code"}
    return err.body


async def completion(client: openai.AsyncOpenAI, **asked: Any) -> Any:
    return await client.completions.create(
        **{"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **asked}
    )


async def test_an_unknown_key_is_401(chain: Chain) -> None:
    for key in ("none", "mk_not-a-key"):
        client = openai.AsyncOpenAI(base_url=chain.base_url, api_key=key, max_retries=0)
        async with client:
            with pytest.raises(openai.AuthenticationError) as caught:
                await completion(client)
        assert caught.value.status_code == 401
        body = error_of(caught.value)
        assert (body["type"], body["code"]) == ("authentication_error", "unauthenticated")
    assert chain.served() == 0


async def test_a_priority_above_the_tenants_ceiling_is_403(chain: Chain) -> None:
    async with chain.client("free", **{"x-meridian-priority": "critical"}) as client:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await completion(client)
    body = error_of(caught.value)
    assert (body["type"], body["code"]) == ("permission_error", "permission_denied")
    assert "sheddable" in body["message"]


async def test_an_unknown_model_is_404_naming_the_known_ones(chain: Chain) -> None:
    async with chain.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await completion(client, model="no-such-model")
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "x"}], stream=True
            )
    body = error_of(caught.value)
    assert body["code"] == "not_found" and repr([MODEL]) in body["message"]


async def test_a_tenant_over_its_rate_is_429_with_retry_after(chain: Chain) -> None:
    # Sent together: sent one after another, a slow chain (a busy machine) lets the bucket
    # (2 per second, burst 2) refill between them and none is ever refused.
    async with chain.client("free") as client:
        plain = await asyncio.gather(
            *(completion(client) for _ in range(6)), return_exceptions=True
        )
        refused = [r for r in plain if isinstance(r, openai.RateLimitError)]
        assert refused, "the request-rate limit never applied"
        served = [r for r in plain if not isinstance(r, BaseException)]
        assert len(served) + len(refused) == 6, plain  # nothing failed any other way
        # Refused before any event: a stream gets the status too, not an SSE error. Four at
        # once against a burst of 2: at least one is refused unless they arrive > 0.5 s apart.
        streams = await asyncio.gather(
            *(completion(client, stream=True) for _ in range(4)), return_exceptions=True
        )
        assert any(isinstance(r, openai.RateLimitError) for r in streams), streams
        for stream in streams:
            if isinstance(stream, BaseException):
                assert isinstance(stream, openai.RateLimitError), stream
            else:
                async for _ in stream:  # read to its end: its usage record says OK
                    pass
    err = refused[0]
    body = error_of(err)
    assert (body["type"], body["code"]) == ("rate_limit_error", "resource_exhausted")
    assert "requests_per_s" in body["message"]
    assert 1 <= int(err.response.headers["retry-after"]) <= 1
    assert 0 < int(err.response.headers["retry-after-ms"]) <= 1000
    records = await chain.wait_usage("free", 10)
    assert len(records) == 10
    assert sorted({r.status for r in records}) == ["OK", "RESOURCE_EXHAUSTED"]


async def test_malformed_routing_headers_are_400_naming_the_header(chain: Chain) -> None:
    for header, value in (
        ("x-meridian-client-geo", "nowhere"),
        ("x-meridian-prority", "critical"),
        ("x-meridian-client-region", "mars"),
    ):
        async with chain.client("gold", **{header: value}) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await completion(client)
        body = error_of(caught.value)
        assert body["code"] == "invalid_argument" and header in body["message"]
    assert chain.served() == 0


async def test_no_healthy_gpu_is_503_and_a_gpu_lost_mid_stream_is_an_error_event(
    chain: Chain,
) -> None:
    async with chain.client() as client:
        stream = await completion(client, max_tokens=4000, stream=True)
        with pytest.raises(openai.APIError) as mid_stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    await chain.workers.stop(0)
        assert not isinstance(mid_stream.value, openai.APIStatusError)  # status was 200
        assert isinstance(mid_stream.value.body, dict) and mid_stream.value.body["code"]
        with pytest.raises(openai.InternalServerError) as caught:
            await completion(client)
    assert caught.value.status_code == 503
    body = error_of(caught.value)
    assert (body["type"], body["code"]) == ("service_unavailable_error", "unavailable")
    records = await chain.wait_usage("gold", 2)
    assert [r.status for r in records][-1] == "UNAVAILABLE" and records[0].status != "OK"


@pytest.mark.parametrize("edge", EDGES)
async def test_a_request_past_openai_timeout_s_is_504_and_frees_its_gpu(
    redis_server: EmbeddedRedis, edge: str
) -> None:
    async with openai_chain(redis_server.url, timeout_s=0.5, time_scale=1.0, edge=edge) as slow:
        async with slow.client() as client:
            with pytest.raises(openai.InternalServerError) as caught:
                await completion(client, max_tokens=2000)  # ~10 s on an A100
            assert caught.value.status_code == 504
            body = error_of(caught.value)
            assert (body["type"], body["code"]) == ("timeout_error", "deadline_exceeded")
            await slow.wait_idle()
            stream = await completion(client, max_tokens=2000, stream=True)
            with pytest.raises(openai.APIError) as late:
                _ = [chunk async for chunk in stream]
            assert isinstance(late.value.body, dict)
            assert late.value.body["code"] == "deadline_exceeded"
            await slow.wait_idle()
        records = await slow.wait_usage("gold", 2)
        assert [r.status for r in records] == ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"]
        assert 0 < records[1].completion_tokens < 2000  # billed what it got


async def test_nothing_is_left_running_after_the_errors(chain: Chain) -> None:
    async with chain.client() as client:
        for _ in range(3):
            with pytest.raises(openai.NotFoundError):
                await completion(client, model="nope")
        assert (await completion(client)).choices[0].text
    await asyncio.sleep(0)
    assert chain.running() == 0 and chain.served() == 1
