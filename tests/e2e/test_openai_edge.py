"""The stock ``openai`` client against the OpenAI edge of a real chain (issue 13, item 1):
unary and streamed, completions and chat, with the tenant's key, through the same
proxy core as V2 (usage records, token counts from the GPU)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from common.basics.redis_embed import EmbeddedRedis
from tests.e2e.openai_chain import EDGES, MODEL, REGION, ZONE, Chain, openai_chain

PROMPT = "tell me about routers"  # 4 prompt tokens (whitespace words)
SYSTEM, USER = "be brief", "hi there"


@pytest.fixture(params=EDGES)
async def chain(
    redis_server: EmbeddedRedis, request: pytest.FixtureRequest
) -> AsyncIterator[Chain]:
    async with openai_chain(redis_server.url, edge=request.param) as running:
        yield running


async def test_a_completion_answers_with_the_gpus_token_counts(chain: Chain) -> None:
    async with chain.client() as client:
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=5
        )
        completion = raw.parse()
    assert raw.headers["x-meridian-route"] == chain.route("g0")
    assert completion.object == "text_completion" and completion.model == MODEL
    assert completion.id.startswith("cmpl-")
    (choice,) = completion.choices
    assert choice.text and choice.finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (4, 5)
    assert completion.usage.total_tokens == 9
    (record,) = await chain.wait_usage("gold", 1)  # one record, whichever tier is the edge
    assert (record.status, record.model) == ("OK", MODEL)
    assert (record.region, record.zone, record.gpu) == (REGION, ZONE, "g0")
    assert (record.prompt_tokens, record.completion_tokens, record.tokens_reported) == (4, 5, True)


async def test_a_chat_reaches_the_gpu_through_the_template(chain: Chain) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    async with chain.client() as client:
        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)  # type: ignore[arg-type]
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    # "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n": 7 words on the GPU.
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (7, 3)


async def test_a_streamed_completion_is_one_chunk_per_token_then_usage(chain: Chain) -> None:
    async with chain.client() as client:
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 6)
    (record,) = await chain.wait_usage("gold", 1)
    assert (record.status, record.completion_tokens) == ("OK", 6)


async def test_a_streamed_chat_names_the_role_first_and_usage_only_when_asked(
    chain: Chain,
) -> None:
    async with chain.client() as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": USER}],
            max_tokens=4,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(contents) == 4
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # include_usage not asked


async def test_the_models_are_listed_and_retrieved(chain: Chain) -> None:
    import openai

    async with chain.client() as client:
        listed = [m.id async for m in client.models.list()]
        assert listed == [MODEL]
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no-such-model")
    async with chain.client(None) as anonymous:
        with pytest.raises(openai.AuthenticationError):
            await anonymous.models.list()


async def test_routing_hints_travel_as_headers(chain: Chain) -> None:
    hints = {"x-meridian-session": "conv-7", "x-meridian-client-region": "eu"}
    async with chain.client("gold", **hints) as client:
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=2
        )
    assert raw.headers["x-meridian-route"] == chain.route("g0")


async def test_internal_headers_from_a_caller_are_dropped(chain: Chain) -> None:
    # Values a tier that believed them would refuse (400) or act on: dropped unread.
    forged = {
        "x-meridian-tenant": chain.ids["gold"],
        "x-meridian-single-request": "1",
        "x-meridian-attempt": "not-a-number",
        "x-meridian-origin": "nowhere",
    }
    async with chain.client("solo", **forged) as client:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    (record,) = await chain.wait_usage("solo", 1)
    assert record.status == "OK"
    assert chain.usage("gold") == []  # billed to the key's tenant, not the forged one
