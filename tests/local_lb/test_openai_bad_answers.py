"""Bad answers from an OpenAI GPU get the right gRPC code at the local tier, and nothing is lost.

The GPU is a real HTTP server on loopback that answers as told by the prompt: malformed
JSON, HTTP 500, 429 with Retry-After, 503, a stream cut before [DONE], a bad chunk, an
error event mid-stream. Its health and metrics are an ordinary vLLM's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from aiohttp import web

from common.basics.errors import RETRY_AFTER_MS
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request
from common.tier.server import TierServer
from local_lb.server import build_local_tier
from sim.topology import one_zone_mapping

REGION, ZONE = "r", "r-1a"
CHUNK = b'data: {"choices": [{"index": 0, "text": "tok", "finish_reason": null}]}\n\n'


@dataclass
class FaultyGpu:
    """An OpenAI server whose completions answer as the prompt says."""

    port: int = field(default_factory=free_port)
    received: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def health(request: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "m"}]})

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text='vllm:num_requests_running{model_name="m"} 0\n')

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        what = body["prompt"]
        self.received.append(what)
        if what == "malformed":
            return web.Response(text='{"choices": [', content_type="application/json")
        if what == "fail":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if what == "busy":
            return web.json_response(
                {"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "3"}
            )
        if what == "unavailable":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(CHUNK)
        if what == "badchunk":
            await response.write(b"data: {not json\n\n")
        elif what == "error-event":
            await response.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
        # "cut": the connection ends here, without [DONE]
        await response.write_eof()
        return response


@dataclass
class Zone:
    gpu: FaultyGpu
    tier: TierServer
    stub: pb_grpc.GRPCInferenceServiceStub

    def nothing_held(self) -> None:
        child = self.tier.children.by_name["bad"]
        assert child.outstanding_requests == 0  # its lease went back
        assert sum(self.tier.balancer.queue_depths().values()) == 0


@pytest.fixture
async def zone(redis_server: EmbeddedRedis) -> AsyncIterator[Zone]:
    gpu = FaultyGpu()
    await gpu.start()
    raw = one_zone_mapping(
        redis_server.url, gpus=1, region=REGION, zone=ZONE, health_interval_s=0.2
    )
    entry = raw["regions"][0]["zones"][0]["gpus"][0]
    entry.update(name="bad", protocol="openai", listen=f"127.0.0.1:{gpu.port}")
    del entry["metrics_listen"]
    topo = topology_from_mapping(raw)
    tier = build_local_tier(topo, REGION, ZONE)
    await tier.start()
    try:
        for _ in range(100):
            if tier.children.by_name["bad"].healthy:
                break
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{tier.port}") as channel:
            yield Zone(gpu, tier, pb_grpc.GRPCInferenceServiceStub(channel))
    finally:
        await tier.stop(0)
        await gpu.stop()


@pytest.mark.parametrize(
    ("prompt", "code", "says"),
    [
        ("malformed", grpc.StatusCode.INTERNAL, "bad answer: malformed JSON"),
        ("fail", grpc.StatusCode.INTERNAL, "HTTP 500: boom"),
        ("busy", grpc.StatusCode.RESOURCE_EXHAUSTED, "HTTP 429: slow down"),
    ],
)
async def test_a_bad_unary_answer_gets_its_code(
    zone: Zone, prompt: str, code: grpc.StatusCode, says: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await zone.stub.ModelInfer(generate_request("m", prompt, 3), timeout=5)
    assert err.value.code() == code
    assert says in (err.value.details() or "")
    assert zone.gpu.received == [prompt]  # sent once: not a failover code
    zone.nothing_held()
    assert zone.tier.children.by_name["bad"].healthy  # the GPU answered: not down


async def test_429_carries_the_gpus_retry_after(zone: Zone) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await zone.stub.ModelInfer(generate_request("m", "busy", 3), timeout=5)
    assert dict(err.value.trailing_metadata() or ())[RETRY_AFTER_MS] == "3000"


async def test_503_marks_the_gpu_down_and_is_unavailable(zone: Zone) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await zone.stub.ModelInfer(generate_request("m", "unavailable", 3), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "overloaded" in (err.value.details() or "")
    zone.nothing_held()


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ("cut", "UNAVAILABLE: "),
        ("badchunk", "INTERNAL: "),
        ("error-event", "INTERNAL: "),
    ],
)
async def test_a_stream_that_breaks_after_its_first_chunk_fails_that_request(
    zone: Zone, prompt: str, says: str
) -> None:
    call = zone.stub.ModelStreamInfer(timeout=5)
    await call.write(generate_request("m", prompt, 5, request_id="x", stream=True))
    await call.done_writing()
    responses = []
    while (r := await call.read()) is not grpc.aio.EOF:
        responses.append(r)
    assert await call.code() == grpc.StatusCode.OK  # the stream itself goes on
    assert responses[0].infer_response.outputs  # the chunk that came went back
    assert responses[-1].error_message.startswith(says)
    assert responses[-1].error_message.endswith("(request id 'x')")
    assert zone.gpu.received == [prompt]
    zone.nothing_held()
