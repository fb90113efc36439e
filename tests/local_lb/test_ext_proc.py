"""The endpoint picker's protocol, spoken by a real gRPC ext_proc client as Envoy would:
the answer's header and metadata, the fallback list, the served endpoint moving the
lease, and the lease released exactly once however the stream ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.topology import topology_from_mapping
from common.gen.envoy.config.core.v3 import base_pb2
from common.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from common.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from common.request.health import GpuCheck
from common.request.v2 import generate_request
from common.tier.server import TierServer
from local_lb.ext_proc import HEALTH_NAMES, ExtProcServer
from local_lb.ext_proc_reply import DESTINATION, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE
from local_lb.server import build_local_tier
from local_lb.state import GpuChild
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers


@dataclass
class Picker:
    tier: TierServer
    stub: ep_grpc.ExternalProcessorStub

    def gpus(self) -> list[GpuChild]:
        return [g for g in self.tier.children.children if isinstance(g, GpuChild)]

    def held(self) -> int:
        return sum(g.outstanding_requests for g in self.gpus())


@pytest.fixture
async def picker(redis_server: EmbeddedRedis) -> AsyncIterator[Picker]:
    """A local tier in picker mode over three emulated GPUs, which no request reaches
    here (the client plays Envoy); health checks 30 s apart after the first."""
    mapping = one_zone_mapping(redis_server.url, gpus=3, health_interval_s=30.0)
    zone = mapping["regions"][0]["zones"][0]
    zone["ext_proc"] = {"listen": f"127.0.0.1:{free_port()}", "fallbacks": 2}
    topology = topology_from_mapping(mapping)
    workers = ZoneWorkers(topology.zone("r", "r-1a"), region="r", time_scale=0.05)
    await workers.start()
    tier = build_local_tier(topology, "r", "r-1a")
    await tier.start()
    server = next(s for s in tier.services if isinstance(s, ExtProcServer))
    try:
        # The first health checks, and the readiness they feed, all in before a test
        # starts: one landing later would undo what the test marked down.
        for _ in range(500):
            if all(g.healthy for g in tier.children.children):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the emulated GPUs were not all ready within 10 s")
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield Picker(tier, ep_grpc.ExternalProcessorStub(channel))
    finally:
        await tier.stop(0)
        await workers.stop(0)


def _headers(pairs: dict[str, str], end: bool = False) -> ep.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=values), end_of_stream=end
        )
    )


GRPC_HEADERS = {
    ":method": "POST",
    ":path": "/inference.GRPCInferenceService/ModelInfer",
    "content-type": "application/grpc",
    DESTINATION: "10.9.9.9:1",  # a caller trying to choose: overwritten
}


def _body(prompt: str = "hello", tokens: int = 3) -> ep.ProcessingRequest:
    message = generate_request("m", prompt, tokens).SerializeToString()
    frame = b"\x00" + len(message).to_bytes(4, "big") + message
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=frame, end_of_stream=True))


def _with_served(request: ep.ProcessingRequest, endpoint: str) -> ep.ProcessingRequest:
    metadata = struct_pb2.Struct()
    metadata.update({SERVED: endpoint})
    request.metadata_context.filter_metadata[LB_NAMESPACE].CopyFrom(metadata)
    return request


def _response_headers(status: str = "200") -> ep.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=":status", raw_value=status.encode())]
    return ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=values))
    )


def _trailers(code: int) -> ep.ProcessingRequest:
    values = [base_pb2.HeaderValue(key="grpc-status", raw_value=str(code).encode())]
    return ep.ProcessingRequest(
        response_trailers=ep.HttpTrailers(trailers=base_pb2.HeaderMap(headers=values))
    )


async def test_answer_names_the_chosen_gpu_then_fallbacks_in_header_and_metadata(
    picker: Picker,
) -> None:
    call = picker.stub.Process()
    await call.write(_headers(GRPC_HEADERS))
    assert (await call.read()).HasField("request_headers")
    await call.write(_body())
    answer = await call.read()
    mutation = answer.request_body.response.header_mutation.set_headers
    assert [h.header.key for h in mutation] == [DESTINATION]
    assert mutation[0].append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    value = mutation[0].header.raw_value.decode()
    assert (
        answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value
        == value
    )
    endpoints = value.split(",")
    addresses = {g.endpoint.address: g for g in picker.gpus()}
    assert len(endpoints) == 3 and set(endpoints) == set(addresses)  # chosen + 2 fallbacks
    assert addresses[endpoints[0]].outstanding_requests == 1 and picker.held() == 1
    await call.write(_trailers(0))
    assert (await call.read()).HasField("response_trailers")
    assert picker.held() == 0  # released on the response's end
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_a_fallback_that_served_takes_the_lease_and_the_chosen_one_is_down(
    picker: Picker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="common.request.children")
    call = picker.stub.Process()
    await call.write(_headers(GRPC_HEADERS))
    await call.read()
    await call.write(_body())
    chosen, fallback = (
        (await call.read()).request_body.response.header_mutation.set_headers[0]
        .header.raw_value.decode().split(",")[:2]
    )  # fmt: skip
    await call.write(_with_served(_response_headers(), fallback))
    reply = await call.read()
    assert list(reply.response_headers.response.header_mutation.remove_headers) == [SERVED]
    by_address = {g.endpoint.address: g for g in picker.gpus()}
    assert by_address[fallback].outstanding_requests == 1
    assert by_address[chosen].outstanding_requests == 0
    # Envoy could not use it: marked down (read from the event, not the state, which the
    # emulated GPU's own health watch may already have set back to up).
    name = by_address[chosen].name
    downs = [r for r in caplog.records if getattr(r, "event", "") == "child_down"]
    assert [getattr(r, "child", "") for r in downs] == [name], downs
    assert "Envoy fell back" in getattr(downs[0], "error", "")
    await call.write(_trailers(0))
    await call.read()
    assert picker.held() == 0
    await call.done_writing()


async def test_a_stream_that_closes_early_releases_its_lease_once(picker: Picker) -> None:
    call = picker.stub.Process()
    await call.write(_headers(GRPC_HEADERS))
    await call.read()
    await call.write(_body())
    await call.read()
    assert picker.held() == 1
    call.cancel()  # the caller went away before any response
    for _ in range(50):
        if picker.held() == 0:
            break
        await asyncio.sleep(0.01)
    assert picker.held() == 0
    assert all(g.healthy for g in picker.gpus())  # a cancelled call teaches nothing


async def test_subset_hint_restricts_the_choice_and_the_fallbacks(picker: Picker) -> None:
    only = picker.gpus()[1].endpoint.address
    call = picker.stub.Process()
    first = _headers(GRPC_HEADERS)
    hint = struct_pb2.Struct()
    hint.update({SUBSET: [only]})
    first.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    await call.write(first)
    await call.read()
    await call.write(_body())
    answer = (await call.read()).request_body.response.header_mutation.set_headers[0]
    assert answer.header.raw_value.decode() == only
    await call.done_writing()


async def test_a_body_not_buffered_is_refused_naming_the_setting(picker: Picker) -> None:
    call = picker.stub.Process()
    await call.write(_headers(GRPC_HEADERS))
    await call.read()
    await call.write(
        ep.ProcessingRequest(request_body=ep.HttpBody(body=b"\x00", end_of_stream=False))
    )
    answer = (await call.read()).immediate_response
    assert (
        answer.status.code == 500 and answer.grpc_status.status == grpc.StatusCode.INTERNAL.value[0]
    )
    assert b"BUFFERED" in answer.body
    assert await call.read() is grpc.aio.EOF and picker.held() == 0


async def test_health_says_serving_under_the_protocol_names(picker: Picker) -> None:
    server = next(s for s in picker.tier.services if isinstance(s, ExtProcServer))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in HEALTH_NAMES:
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        for _ in range(100):
            # Every GPU down, as health checks answering NOT_SERVING say: a refusal is
            # never overruled by panic routing, which a failed forward would be while the
            # GPU's channel is still connected. Again each turn: a health watch's first
            # SERVING arriving late on a busy machine would bring one back.
            for gpu in picker.gpus():
                picker.tier.balancer.readiness.probed(
                    gpu.name, GpuCheck(healthy=False, reason="NOT_SERVING: test")
                )
            await asyncio.sleep(0.02)
            answer = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
            if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
        assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
