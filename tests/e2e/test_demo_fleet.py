"""End to end through real processes: global -> regional -> local -> emulated GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis

from cli.launcher import Fleet
from common.capacity.streams import region_stream, zone_stream
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.meridian.v1 import capacity_pb2
from common.request.v2 import generate_request, response_text
from tests.client import V2Client, expect_code, gpu_metric, region_of, streamed_tokens, zone_of

DUBLIN = ("x-meridian-client-geo", "53.35,-6.26")
SINGAPORE = ("x-meridian-client-geo", "1.35,103.82")


@pytest.fixture(scope="module")
def client(demo_fleet: Fleet):
    with V2Client(demo_fleet.global_address) as c:
        yield c


def served_requests(fleet: Fleet) -> float:
    """Successful requests counted by every emulated GPU's /metrics."""
    return gpu_metric(fleet, "vllm:request_success_total")


def test_unary_through_all_three_tiers(client: V2Client) -> None:
    reply = client.infer("what is a load balancer", 5, metadata=[DUBLIN])
    assert len(reply.text.split()) == 5
    region, zone, gpu = reply.route.split("/")
    assert region == "eu-west" and zone.startswith("eu-west-") and gpu.startswith(zone)


def test_streaming_through_all_three_tiers(client: V2Client) -> None:
    request = generate_request("demo-llm", "stream me some tokens", 6, stream=True)
    responses, route = client.stream([request], metadata=[SINGAPORE])
    assert [r.error_message for r in responses] == [""] * 6
    finals = [r.infer_response.parameters["triton_final_response"].bool_param for r in responses]
    assert finals == [False] * 5 + [True]
    assert all(response_text(r.infer_response) for r in responses)
    assert region_of(route) == "ap-southeast"


def test_several_requests_on_one_stream(client: V2Client) -> None:
    requests = [
        generate_request("demo-llm", f"prompt {i}", 3, request_id=f"r{i}") for i in range(3)
    ]
    responses, _ = client.stream(requests, metadata=[DUBLIN])
    by_id: dict[str, list[pb.ModelInferResponse]] = {}
    for r in responses:
        by_id.setdefault(r.infer_response.id, []).append(r.infer_response)
    # Tokens per request, however many the relay joined into one response.
    assert {i: streamed_tokens(rs) for i, rs in by_id.items()} == {"r0": 3, "r1": 3, "r2": 3}


@pytest.mark.parametrize(
    ("metadata", "region"),
    [
        ([DUBLIN], "eu-west"),
        ([("x-meridian-client-geo", "51.51,-0.13")], "eu-west"),  # London
        ([SINGAPORE], "ap-southeast"),
        ([("x-meridian-client-geo", "35.68,139.69")], "ap-southeast"),  # Tokyo
        ([("x-meridian-client-geo", "37.77,-122.42")], "us-east"),  # San Francisco
        ([("x-meridian-client-region", "eu-west")], "eu-west"),
        ([], "us-east"),  # no hint: nearest to the global tier's own location
    ],
)
def test_geography(client: V2Client, metadata: list[tuple[str, str]], region: str) -> None:
    assert region_of(client.infer(metadata=metadata).route) == region


def test_client_zone_is_the_nearest_zone(client: V2Client) -> None:
    near_1b = ("x-meridian-client-geo", "1.36,104.0")
    assert zone_of(client.infer(metadata=[near_1b]).route) == "ap-southeast-1b"


def test_server_metadata_and_readiness(client: V2Client) -> None:
    assert client.stub.ServerLive(pb.ServerLiveRequest()).live
    assert client.stub.ServerReady(pb.ServerReadyRequest()).ready
    assert client.stub.ModelReady(pb.ModelReadyRequest(name="demo-llm")).ready
    assert not client.stub.ModelReady(pb.ModelReadyRequest(name="nope")).ready
    assert client.stub.ServerMetadata(pb.ServerMetadataRequest()).name == "meridian-global"
    meta = client.stub.ModelMetadata(pb.ModelMetadataRequest(name="demo-llm"))
    assert next((t.name, t.datatype) for t in meta.inputs) == ("text_input", "BYTES")
    assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]


class TestErrors:
    """Each bad input gets its exact status code, and no GPU serves anything for it."""

    def check_nothing_served(self, fleet: Fleet, before: float, client: V2Client) -> None:
        # Only the one good request that follows may reach a GPU.
        client.infer(metadata=[DUBLIN])
        assert served_requests(fleet) == before + 1

    def test_unknown_model(self, client: V2Client, demo_fleet: Fleet) -> None:
        before = served_requests(demo_fleet)
        err = expect_code(grpc.StatusCode.NOT_FOUND, client.infer, model="gpt-17")
        assert "gpt-17" in err.details() and "demo-llm" in err.details()
        expect_code(
            grpc.StatusCode.NOT_FOUND,
            client.stub.ModelMetadata,
            pb.ModelMetadataRequest(name="gpt-17"),
        )
        self.check_nothing_served(demo_fleet, before, client)

    def test_missing_text_input(self, client: V2Client, demo_fleet: Fleet) -> None:
        before = served_requests(demo_fleet)
        err = expect_code(
            grpc.StatusCode.INVALID_ARGUMENT,
            client.infer,
            request=pb.ModelInferRequest(model_name="demo-llm"),
        )
        assert "text_input" in err.details()
        self.check_nothing_served(demo_fleet, before, client)

    def test_ill_typed_text_input(self, client: V2Client, demo_fleet: Fleet) -> None:
        before = served_requests(demo_fleet)
        request = pb.ModelInferRequest(model_name="demo-llm")
        request.inputs.add(
            name="text_input", datatype="FP32", shape=[1]
        ).contents.fp32_contents.append(1)
        err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, client.infer, request=request)
        assert "BYTES" in err.details()
        self.check_nothing_served(demo_fleet, before, client)

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("x-meridian-client-geo", "somewhere in europe"),
            ("x-meridian-client-geo", "91,0"),
            ("x-meridian-client-region", "mars-north"),
            ("x-meridian-priority", "urgent"),
        ],
    )
    def test_malformed_routing_metadata_names_the_key(
        self, client: V2Client, demo_fleet: Fleet, key: str, value: str
    ) -> None:
        before = served_requests(demo_fleet)
        err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, client.infer, metadata=[(key, value)])
        assert key in err.details()
        self.check_nothing_served(demo_fleet, before, client)

    def test_bad_request_inside_a_stream_gets_error_message_and_stream_goes_on(
        self, client: V2Client
    ) -> None:
        bad = pb.ModelInferRequest(model_name="demo-llm", id="bad")
        good = generate_request("demo-llm", "fine", 2, request_id="good")
        responses, _ = client.stream([bad, good], metadata=[DUBLIN])
        errors = [r.error_message for r in responses if r.error_message]
        assert len(errors) == 1 and errors[0].startswith("INVALID_ARGUMENT")
        assert sum(1 for r in responses if r.infer_response.id == "good") == 2

    def test_malformed_metadata_on_a_stream(self, client: V2Client) -> None:
        request = generate_request("demo-llm", "x", 2)
        err = expect_code(
            grpc.StatusCode.INVALID_ARGUMENT,
            client.stream,
            [request],
            metadata=[("x-meridian-client-geo", "x")],
        )
        assert "x-meridian-client-geo" in err.details()


def test_deadline_passes_down_and_work_is_released(client: V2Client, demo_fleet: Fleet) -> None:
    """The GPU stops working on a request once its caller's deadline is spent."""
    start = time.monotonic()
    expect_code(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        client.infer,
        "long job",
        8000,
        metadata=[DUBLIN],
        timeout=0.2,
    )
    assert time.monotonic() - start < 2.0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if running_requests(demo_fleet) == 0:
            return
        time.sleep(0.1)
    pytest.fail("a GPU still runs the request after its deadline")


def running_requests(fleet: Fleet) -> float:
    return gpu_metric(fleet, "vllm:num_requests_running")


def test_summaries_read_back_from_redis(demo_fleet: Fleet) -> None:
    client = redis.Redis.from_url(demo_fleet.topology.redis_url)
    try:
        time.sleep(2 * demo_fleet.topology.summary_cadence_s)
        for region in demo_fleet.topology.regions:
            for zone in region.zones:
                entries = client.xrange(zone_stream(region.name, zone.name))
                assert entries, f"no summary for {zone.name}"
                latest = capacity_pb2.CapacitySummary.FromString(entries[-1][1][b"summary"])
                (model,) = latest.models
                assert (latest.region, latest.zone, model.model) == (
                    region.name,
                    zone.name,
                    "demo-llm",
                )
                assert model.healthy_gpus == model.total_gpus == 4
                assert model.total_slots == 4 * 16
                assert latest.sequence >= 2
            entries = client.xrange(region_stream(region.name))
            latest = capacity_pb2.CapacitySummary.FromString(entries[-1][1][b"summary"])
            assert latest.models[0].healthy_gpus == 8
            assert latest.models[0].total_slots == 128
    finally:
        client.close()


def test_stock_tritonclient_against_the_global_endpoint(demo_fleet: Fleet) -> None:
    script = Path(__file__).with_name("triton_client_check.py")
    done = subprocess.run(
        [sys.executable, str(script), demo_fleet.global_address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["live"] and out["ready"] and out["model_ready"]
    assert out["server_name"] == "meridian-global"
    assert ["text_input", "BYTES"] in out["inputs"]
    assert len(out["unary_text"].split()) == 6
    assert out["stream_errors"] == []
    # One response per token, unless tokens that came while a tier wrote went up as one.
    assert 1 <= len(out["stream_tokens"]) <= 5
    finals = out["stream_finals"]
    assert finals == [False] * (len(finals) - 1) + [True]


def test_health_and_reflection_on_the_global_tier(demo_fleet: Fleet) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(demo_fleet.global_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=5
        ).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        services = {s.name for r in replies for s in r.list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
