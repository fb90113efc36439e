"""An OpenAI GPU behind the local tier, mixed with a V2 GPU in one zone (real servers).

g0 is an emulated GPU speaking vLLM's OpenAI HTTP API, g1 an emulated V2 GPU; the local
tier is called over real gRPC as its regional tier would call it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE
from common.request.tokens import TokenCount
from common.request.v2 import generate_request, response_text
from common.tier.server import TierServer
from local_lb.openai_wire import OPENAI_BODY, OPENAI_ROUTE
from local_lb.server import build_local_tier
from sim.topology import one_zone_mapping
from sim.worker import GpuWorker, ZoneWorkers
from tests.client import streamed_tokens

REGION, ZONE = "r", "r-1a"


def mapping(redis_url: str, health_interval_s: float) -> dict[str, Any]:
    raw = one_zone_mapping(
        redis_url,
        gpus=2,
        region=REGION,
        zone=ZONE,
        health_interval_s=health_interval_s,
        slow_start_window_s=0,
    )
    g0 = raw["regions"][0]["zones"][0]["gpus"][0]
    g0["protocol"] = "openai"
    del g0["metrics_listen"]  # vLLM's: /metrics on the API port
    return raw


@dataclass
class Zone:
    workers: ZoneWorkers
    tier: TierServer
    stub: pb_grpc.GRPCInferenceServiceStub

    def worker(self, name: str) -> GpuWorker:
        return next(w for w in self.workers if w.gpu.name == name)

    def only(self, name: str) -> None:
        """Drain every other GPU: requests go to ``name``."""
        for child in self.tier.children:
            self.tier.children.set_drained(child, child.name != name)


async def start_zone(redis_url: str, health_interval_s: float) -> tuple[ZoneWorkers, TierServer]:
    topo = topology_from_mapping(mapping(redis_url, health_interval_s))
    workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=0.05)
    await workers.start()
    tier = build_local_tier(topo, REGION, ZONE)
    await tier.start()
    return workers, tier


@pytest.fixture(params=[0.2])
async def zone(request: pytest.FixtureRequest, redis_server: EmbeddedRedis) -> AsyncIterator[Zone]:
    workers, tier = await start_zone(redis_server.url, request.param)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{tier.port}") as channel:
            yield Zone(workers, tier, pb_grpc.GRPCInferenceServiceStub(channel))
    finally:
        await tier.stop(0)
        await workers.stop(0)
    for w in workers:  # every request ended: nothing holds a GPU's KV
        assert (w.engine.running, w.engine.waiting) == (0, 0)


async def wait_healthy(zone: Zone, *names: str) -> None:
    for _ in range(100):
        if all(zone.tier.children.by_name[n].healthy for n in names):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not healthy: {names}")


async def unary(zone: Zone, request: pb.ModelInferRequest) -> tuple[pb.ModelInferResponse, str]:
    call = zone.stub.ModelInfer(request, timeout=10)
    response = await call
    return response, dict(await call.trailing_metadata())[ROUTE]


async def stream_one(
    zone: Zone, request: pb.ModelInferRequest
) -> list[pb.ModelStreamInferResponse]:
    call = zone.stub.ModelStreamInfer(timeout=10)
    await call.write(request)
    await call.done_writing()
    responses = [r async for r in call]
    assert await call.code() == grpc.StatusCode.OK
    return responses


def counts(*responses: pb.ModelInferResponse) -> tuple[int | None, int | None]:
    count = TokenCount()
    for r in responses:
        count.add(r)
    return count.prompt, count.completion


async def test_both_kinds_serve_in_one_zone(zone: Zone) -> None:
    await wait_healthy(zone, "g0", "g1")
    routes = set()
    for _ in range(40):
        response, route = await unary(zone, generate_request("m", "one two three", 4))
        assert len(response_text(response).split()) == 4
        assert counts(response) == (3, 4)  # the server's own counts, from either protocol
        routes.add(route)
        if len(routes) == 2:
            break
    assert routes == {f"{ZONE}/g0", f"{ZONE}/g1"}


async def test_unary_through_the_openai_gpu_carries_its_usage(zone: Zone) -> None:
    await wait_healthy(zone, "g0")
    zone.only("g0")
    response, route = await unary(zone, generate_request("m", "a b c d e", 6, request_id="u1"))
    assert route == f"{ZONE}/g0" and response.id == "u1"
    assert len(response_text(response).split()) == 6
    assert counts(response) == (5, 6)
    assert zone.worker("g0").engine.requests_total == 1


async def test_a_stream_through_the_openai_gpu_one_response_per_chunk(zone: Zone) -> None:
    await wait_healthy(zone, "g0")
    zone.only("g0")
    request = generate_request("m", "a b", 5, request_id="s1", stream=True)
    responses = [r.infer_response for r in await stream_one(zone, request)]
    with_text = [r for r in responses if r.outputs]
    # One per token chunk, unless chunks that came while the relay wrote went up as one.
    assert 1 <= len(with_text) <= 5
    assert len("".join(response_text(r) for r in with_text).split()) == 5
    last = responses[-1]
    assert last.parameters["triton_final_response"].bool_param
    assert not any(r.parameters["triton_final_response"].bool_param for r in responses[:-1])
    assert counts(*responses) == (2, 5)  # from the usage chunk, on the last
    assert all(r.id == "s1" for r in responses)


async def test_stream_false_on_a_stream_is_one_final_response(zone: Zone) -> None:
    await wait_healthy(zone, "g0")
    zone.only("g0")
    request = generate_request("m", "a b", 3, request_id="w")
    request.parameters["stream"].bool_param = False
    (only,) = [r.infer_response for r in await stream_one(zone, request)]
    assert len(response_text(only).split()) == 3
    assert only.parameters["triton_final_response"].bool_param
    assert counts(only) == (2, 3)


async def test_the_callers_chat_body_reaches_the_openai_gpu_as_it_came(zone: Zone) -> None:
    await wait_healthy(zone, "g0")
    zone.only("g0")
    request = generate_request("m", "rendered by the edge", 3)
    request.parameters[OPENAI_ROUTE].string_param = "chat.completions"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request.parameters[OPENAI_BODY].string_param = json.dumps(
        {"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0}
    )
    response, _ = await unary(zone, request)
    # The emulator renders the messages itself ("system: be brief\nuser: hi": 5 words),
    # not the edge's text_input (4 words): the messages arrived.
    assert counts(response) == (5, 3)
    streamed = generate_request("m", "x", 3, stream=True)
    streamed.parameters[OPENAI_ROUTE].string_param = "chat.completions"
    streamed.parameters[OPENAI_BODY].string_param = request.parameters[OPENAI_BODY].string_param
    responses = [r.infer_response for r in await stream_one(zone, streamed)]
    assert len("".join(response_text(r) for r in responses).split()) == 3


async def test_the_openai_gpus_load_is_read_from_its_metrics(zone: Zone) -> None:
    await wait_healthy(zone, "g0")
    zone.only("g0")
    call = zone.stub.ModelStreamInfer(timeout=20)
    await call.write(generate_request("m", "long", 2000, stream=True))
    await call.read()  # it is generating
    book, seen = zone.tier.balancer.view.load, None
    for _ in range(100):
        seen = book.get("g0", asyncio.get_running_loop().time(), 10.0)
        if seen is not None and seen.running >= 1:
            break
        await asyncio.sleep(0.02)
    assert seen is not None and seen.running == 1 and seen.source == "metrics"
    assert seen.kv_cache_usage is not None and seen.kv_cache_usage > 0
    call.cancel()


async def test_an_unknown_route_is_invalid_argument_and_nothing_is_sent(zone: Zone) -> None:
    await wait_healthy(zone, "g0")
    zone.only("g0")
    request = generate_request("m", "x", 3)
    request.parameters[OPENAI_ROUTE].string_param = "embeddings"
    request.parameters[OPENAI_BODY].string_param = "{}"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unary(zone, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert zone.worker("g0").engine.requests_total == 0
    g0 = zone.tier.children.by_name["g0"]
    assert g0.healthy and g0.outstanding_requests == 0


@pytest.mark.parametrize("zone", [30.0], indirect=True)
async def test_a_killed_openai_gpu_is_failed_over(zone: Zone) -> None:
    """Health checks 30 s apart: only a failed forward can find it gone."""
    await asyncio.sleep(0.3)  # the monitor's first check
    await zone.worker("g0").stop(0)
    dead = zone.tier.children.by_name["g0"]
    for _ in range(20):  # whichever GPU is tried first, every request succeeds
        response, route = await unary(zone, generate_request("m", "hello", 3))
        assert route == f"{ZONE}/g1" and len(response_text(response).split()) == 3
        if not dead.healthy:
            break
    assert not dead.healthy and "UNAVAILABLE" in dead.last_error
    for _ in range(3):  # streams too, before their first byte
        responses = await stream_one(zone, generate_request("m", "s", 3, stream=True))
        assert not any(r.error_message for r in responses)
        assert streamed_tokens([r.infer_response for r in responses]) == 3
    assert dead.outstanding_requests == 0


async def test_an_openai_gpu_killed_mid_stream_fails_that_request_only(zone: Zone) -> None:
    await wait_healthy(zone, "g0", "g1")
    zone.only("g0")
    call = zone.stub.ModelStreamInfer(timeout=20)
    await call.write(generate_request("m", "long answer", 4000, request_id="long", stream=True))
    first = await call.read()
    assert first.infer_response.outputs  # committed: no failover from here on
    for child in zone.tier.children:
        zone.tier.children.set_drained(child, False)
    served_before = zone.worker("g1").engine.requests_total
    await zone.worker("g0").stop(0)
    while not (response := await call.read()).error_message:
        assert response.infer_response.outputs
    assert response.error_message.startswith("UNAVAILABLE: ")
    assert response.error_message.endswith("(request id 'long')")
    await call.write(generate_request("m", "next", 2, request_id="next", stream=True))
    await call.done_writing()
    rest = []
    while (more := await call.read()) is not grpc.aio.EOF:
        rest.append(more)
    assert [r.infer_response.id for r in rest] == ["next", "next"]  # the stream goes on
    assert zone.worker("g1").engine.requests_total == served_before + 1  # nothing replayed
    assert zone.tier.children.by_name["g0"].outstanding_requests == 0
