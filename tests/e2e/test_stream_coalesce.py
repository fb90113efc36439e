"""Coalescing relays through a real chain (emulated GPU → local → regional → global,
with the global tier's OpenAI edge), read by stock clients: what a tier's writer could
not send at once goes up as one message, every token exactly once and in order, the
counts the GPU's; a reader that keeps up gets one message per token; an inner tier
passes its child's responses up unchanged."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request, response_text
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.engine import _WORDS
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers
from tests.e2e.chain import running_chain

REGION, ZONE, MODEL = "r", "r-1a", "m"
PROMPT = "tell me about routers"  # 4 prompt tokens (whitespace words)


def expected_words(prompt: str, n: int) -> list[str]:
    """The emulated GPU's answer: its words drawn from a generator seeded by the prompt."""
    seed = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(seed, "little"))
    return [_WORDS[rng.randrange(len(_WORDS))] for _ in range(n)]


class Chain:
    def __init__(self, topo: Topology, workers: ZoneWorkers, openai_url: str) -> None:
        self.topo = topo
        self.workers = workers
        self.openai_url = openai_url

    @property
    def global_address(self) -> str:
        return self.topo.global_tier.endpoint.address

    @property
    def regional_address(self) -> str:
        return self.topo.regions[0].endpoint.address

    @property
    def gpu_address(self) -> str:
        return self.topo.regions[0].zones[0].gpus[0].endpoint.address


Start = Callable[..., AbstractAsyncContextManager[Chain]]


@pytest.fixture
def chain(redis_server: EmbeddedRedis) -> Start:
    @asynccontextmanager
    async def start(*, time_scale: float, coalesce_ms: float = 0) -> AsyncIterator[Chain]:
        mapping = one_zone_mapping(
            redis_server.url,
            model=MODEL,
            gpus=1,
            region=REGION,
            zone=ZONE,
            global_listen=f"127.0.0.1:{free_port()}",
            region_listen=f"127.0.0.1:{free_port()}",
            health_interval_s=0.5,
            slow_start_window_s=0,
        )
        mapping["global"]["openai_listen"] = "127.0.0.1:0"
        mapping["limits"] = {"stream_coalesce_ms": coalesce_ms}
        topo = topology_from_mapping(mapping)
        workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=time_scale)
        edge = build_global_tier(topo)
        tiers = [build_local_tier(topo, REGION, ZONE), build_regional_tier(topo, REGION), edge]
        try:
            async with running_chain(topo, workers, tiers, MODEL):
                assert edge.openai_edge is not None
                yield Chain(topo, workers, f"http://{edge.openai_edge.address}/v1")
        finally:
            # The openai client resolves its host on the loop's default executor.
            await asyncio.get_running_loop().shutdown_default_executor()

    return start


async def v2_stream(address: str, request: pb.ModelInferRequest) -> list[pb.ModelInferResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call: Any = stub.ModelStreamInfer(iter((request,)), timeout=30)
        responses = [r async for r in call]
        assert await call.code() == grpc.StatusCode.OK
    assert not [r.error_message for r in responses if r.error_message]
    return [r.infer_response for r in responses]


async def sse_chunks(chain: Chain, max_tokens: int) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=chain.openai_url, api_key="none", max_retries=0)
    async with client:
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [chunk async for chunk in stream]


async def test_a_slow_v2_reader_gets_every_token_once_in_order_in_fewer_messages(
    chain: Start,
) -> None:
    """tritonclient reads one response per 20 ms while the GPU makes one per ~0.2 ms;
    each response carries a 4 KB request id, so 16 unread fill the reader's 64 KiB
    HTTP/2 window and the global tier's writer waits: what arrives meanwhile goes up
    as one response."""
    tokens = 120
    async with chain(time_scale=0.05) as c:
        script = Path(__file__).with_name("triton_slow_reader.py")
        argv = [c.global_address, PROMPT, str(tokens), "x" * 4096, "0.02"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), *argv, stdout=PIPE, stderr=PIPE
        )
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    out = json.loads(stdout.decode().strip().splitlines()[-1])
    assert out["errors"] == []
    assert "".join(out["texts"]) == "".join(expected_words(PROMPT, tokens))
    assert 1 < len(out["texts"]) < tokens
    assert out["finals"] == [False] * (len(out["finals"]) - 1) + [True]
    assert out["counts"][-1] == [4, tokens]  # the GPU's totals, on the last response


async def test_a_coalescing_window_sends_sse_tokens_in_fewer_chunks(chain: Start) -> None:
    """With ``stream_coalesce_ms`` the local tier holds what follows the first token that
    long (a token every ~2 ms here); the stock openai client gets every token once, in
    order, the first alone, and the usage the GPU counted."""
    tokens = 40
    async with chain(time_scale=0.5, coalesce_ms=50) as c:
        chunks = await sse_chunks(c, tokens)
        responses = await v2_stream(
            c.global_address, generate_request(MODEL, PROMPT, tokens, stream=True)
        )
    texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    # The emulated GPU's tokens are bare words: joined, the text has no spaces.
    assert "".join(texts) == "".join(expected_words(PROMPT, tokens))
    assert 1 < len(texts) < tokens // 4 and texts[0] == expected_words(PROMPT, 1)[0]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (4, tokens)
    assert "".join(response_text(r) for r in responses) == "".join(expected_words(PROMPT, tokens))
    assert 1 < len(responses) < tokens // 4
    assert response_text(responses[0]) == expected_words(PROMPT, 1)[0]
    last = responses[-1].parameters
    assert (last["prompt_tokens"].int64_param, last["completion_tokens"].int64_param) == (
        4,
        tokens,
    )


async def test_a_reader_that_keeps_up_gets_one_message_per_token(chain: Start) -> None:
    """At low load (a token every ~40 ms) nothing waits: one response, one chunk, each."""
    tokens = 8
    async with chain(time_scale=10) as c:
        request = generate_request(MODEL, PROMPT, tokens, stream=True)
        responses = await v2_stream(c.global_address, request)
        chunks = await sse_chunks(c, tokens)
    assert [response_text(r) for r in responses] == expected_words(PROMPT, tokens)
    texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    assert texts == expected_words(PROMPT, tokens)


async def test_an_inner_tier_passes_its_childs_responses_through_unchanged(
    chain: Start,
) -> None:
    """Through the regional and local tiers the responses are the GPU's own, one for one."""
    tokens = 6
    async with chain(time_scale=10) as c:
        request = generate_request(MODEL, PROMPT, tokens, request_id="same", stream=True)
        direct = await v2_stream(c.gpu_address, request)
        relayed = await v2_stream(c.regional_address, request)
    assert len(direct) == tokens
    assert relayed == direct
