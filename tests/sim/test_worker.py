"""GpuWorker over real gRPC and HTTP on loopback: V2 service, trailers, streams, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest

from common.basics.geo import GeoPoint
from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from common.config.topology import ZoneConfig
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import FINAL_RESPONSE, generate_request, response_text
from sim.worker import STREAM_QUEUE_RESPONSES, GpuWorker, ZoneWorkers, run_zone_workers

LOAD_RE = re.compile(r"^running=\d+,waiting=\d+,kv=[01]\.\d{3}$")
SAMPLE_RE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*\{model_name="[^"]*"\} -?[0-9.eE+-]+$')


def gpu_config(name: str = "gpu-0", hardware: str = "A100") -> GpuConfig:
    return GpuConfig(
        name=name,
        endpoint=Endpoint("127.0.0.1", 0),
        metrics_endpoint=Endpoint("127.0.0.1", 0),
        hardware=hardware,
        models=("llama", "mistral"),
        kv_cache_tokens=4096,
    )


@pytest.fixture
async def worker() -> AsyncIterator[GpuWorker]:
    w = GpuWorker(gpu_config(), region="eu", zone="eu-a", time_scale=0.05)
    await w.start()
    try:
        yield w
    finally:
        await w.stop(0)
    # Every request ended (finished, failed or cancelled) must have released its KV.
    assert (w.engine.running, w.engine.waiting, w.engine.kv_cache_usage) == (0, 0, 0.0)


@pytest.fixture
async def stub(worker: GpuWorker) -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def trailers(metadata: grpc.aio.Metadata) -> dict[str, str]:
    return {key: value for key, value in metadata}


def with_version(request: pb.ModelInferRequest, version: str) -> pb.ModelInferRequest:
    request.model_version = version
    return request


def is_final(response: pb.ModelInferResponse) -> bool:
    return response.parameters[FINAL_RESPONSE].bool_param


async def test_server_live_ready_and_metadata(
    stub: pb_grpc.GRPCInferenceServiceStub, worker: GpuWorker
) -> None:
    assert (await stub.ServerLive(pb.ServerLiveRequest())).live
    assert (await stub.ServerReady(pb.ServerReadyRequest())).ready
    meta = await stub.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "meridian-sim-gpu" and meta.version and list(meta.extensions) == []


@pytest.mark.parametrize(
    ("name", "version", "ready"),
    [("llama", "", True), ("mistral", "1", True), ("llama", "2", False), ("gpt", "", False)],
)
async def test_model_ready(
    stub: pb_grpc.GRPCInferenceServiceStub, name: str, version: str, ready: bool
) -> None:
    call = stub.ModelReady(pb.ModelReadyRequest(name=name, version=version))
    assert (await call).ready is ready
    assert trailers(await call.trailing_metadata())["x-meridian-route"] == "gpu-0"


async def test_model_metadata_shape(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="llama"))
    assert (meta.name, list(meta.versions), meta.platform) == ("llama", ["1"], "meridian-sim")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("text_input", "BYTES", [1]),
        ("max_tokens", "INT32", [1]),
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("text_output", "BYTES", [-1])
    ]


async def test_model_metadata_unknown_model_is_not_found(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ModelMetadata(pb.ModelMetadataRequest(name="gpt"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "gpt" in (err.value.details() or "")
    assert LOAD_RE.match(trailers(err.value.trailing_metadata())["x-meridian-load"])


async def test_unary_infer_returns_text_and_load_trailers(
    stub: pb_grpc.GRPCInferenceServiceStub, worker: GpuWorker
) -> None:
    call = stub.ModelInfer(generate_request("llama", "hello there world", 12, request_id="r1"))
    response = await call
    assert len(response_text(response).split()) == 12
    assert (response.model_name, response.id) == ("llama", "r1")
    assert FINAL_RESPONSE not in response.parameters
    meta = trailers(await call.trailing_metadata())
    assert meta["x-meridian-route"] == "gpu-0"
    assert LOAD_RE.match(meta["x-meridian-load"]), meta["x-meridian-load"]
    stats = worker.engine.stats("llama")
    assert (stats.requests_succeeded_total, stats.prompt_tokens_total) == (1, 3)


def counts(response: pb.ModelInferResponse) -> tuple[int, int] | None:
    params = response.parameters
    if "prompt_tokens" not in params:
        return None
    return params["prompt_tokens"].int64_param, params["completion_tokens"].int64_param


def streamed_text(responses: list[pb.ModelStreamInferResponse]) -> str:
    return "".join(response_text(r.infer_response) for r in responses)


async def unary_words(stub: pb_grpc.GRPCInferenceServiceStub, prompt: str, tokens: int) -> str:
    """The emulated model's answer to ``prompt`` (the same words streamed), unspaced."""
    response = await stub.ModelInfer(generate_request("llama", prompt, tokens))
    return "".join(response_text(response).split())


def answering(request: pb.ModelInferRequest, tokens: int) -> pb.ModelInferRequest:
    request.parameters["sim_answer_tokens"].int64_param = tokens
    return request


async def test_unary_infer_reports_the_tokens_it_processed_and_generated(
    stub: pb_grpc.GRPCInferenceServiceStub, worker: GpuWorker
) -> None:
    response = await stub.ModelInfer(generate_request("llama", "hello there world", 12))
    assert counts(response) == (3, 12)
    # The answer ends (an emulated end of sequence) after 5 of the 100 tokens asked for.
    response = await stub.ModelInfer(answering(generate_request("llama", "hi", 100), 5))
    assert len(response_text(response).split()) == 5 and counts(response) == (1, 5)
    assert worker.engine.stats("llama").tokens_generated_total == 12 + 5


async def test_stream_reports_the_counts_so_far_on_every_response(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    call = stub.ModelStreamInfer()
    request = generate_request("llama", "stream me", 50, request_id="s1", stream=True)
    await call.write(answering(request, 4))
    whole = answering(generate_request("llama", "all at once", 50, request_id="s2"), 3)
    whole.parameters["stream"].bool_param = False
    await call.write(whole)
    await call.done_writing()
    by_id: dict[str, list[pb.ModelInferResponse]] = {"s1": [], "s2": []}
    async for r in call:
        by_id[r.infer_response.id].append(r.infer_response)
    # The counts so far on every response (fewer responses when tokens were merged).
    completions = [counts(r)[1] for r in by_id["s1"]]  # type: ignore[index]
    assert completions == sorted(set(completions))
    assert counts(by_id["s1"][-1]) == (2, 4) and is_final(by_id["s1"][-1])
    assert [is_final(r) for r in by_id["s1"]].count(True) == 1
    [one] = by_id["s2"]
    assert counts(one) == (3, 3) and is_final(one) and len(response_text(one).split()) == 3


async def test_a_gpu_that_does_not_report_tokens_sends_no_counts() -> None:
    config = dataclasses.replace(gpu_config(), report_tokens=False)
    worker = GpuWorker(config, region="eu", zone="eu-a", time_scale=0.05)
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            response = await stub.ModelInfer(answering(generate_request("llama", "hi", 9), 2))
            assert counts(response) is None and len(response_text(response).split()) == 2
    finally:
        await worker.stop(0)


@pytest.mark.parametrize("bad", [0, -3])
async def test_a_bad_answer_length_is_invalid_argument(
    stub: pb_grpc.GRPCInferenceServiceStub, worker: GpuWorker, bad: int
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ModelInfer(answering(generate_request("llama", "hi", 9), bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sim_answer_tokens" in (err.value.details() or "")
    assert worker.engine.stats().requests_total == 0


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (generate_request("gpt", "hi", 4), grpc.StatusCode.NOT_FOUND),
        (pb.ModelInferRequest(model_name="llama"), grpc.StatusCode.INVALID_ARGUMENT),
        (with_version(generate_request("llama", "hi", 4), "9"), grpc.StatusCode.NOT_FOUND),
        (generate_request("llama", "word " * 4000, 200), grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["unknown-model", "missing-text-input", "unknown-version", "larger-than-kv-cache"],
)
async def test_unary_infer_errors(
    stub: pb_grpc.GRPCInferenceServiceStub,
    worker: GpuWorker,
    request_: pb.ModelInferRequest,
    code: grpc.StatusCode,
) -> None:
    call = stub.ModelInfer(request_)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code
    assert err.value.details()
    assert trailers(err.value.trailing_metadata())["x-meridian-route"] == "gpu-0"
    assert worker.engine.stats().requests_succeeded_total == 0


async def test_stream_sends_every_token_once_in_order_last_one_final(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    """One response per token, or fewer when tokens waited together for the writer
    (``sim.stream_out``): the text is the unary answer's words, in order."""
    call = stub.ModelStreamInfer()
    await call.write(generate_request("llama", "stream me", 9, request_id="s1", stream=True))
    await call.done_writing()
    responses = [r async for r in call]
    assert all(not r.error_message for r in responses)
    assert streamed_text(responses) == await unary_words(stub, "stream me", 9)
    completions = [counts(r.infer_response)[1] for r in responses]  # type: ignore[index]
    assert completions == sorted(set(completions)) and completions[-1] == 9
    assert [is_final(r.infer_response) for r in responses][-1]
    assert sum(is_final(r.infer_response) for r in responses) == 1
    assert {r.infer_response.id for r in responses} == {"s1"}
    meta = trailers(await call.trailing_metadata())
    assert meta["x-meridian-route"] == "gpu-0"
    assert LOAD_RE.match(meta["x-meridian-load"])


async def test_stream_false_sends_one_final_response(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    call = stub.ModelStreamInfer()
    request = generate_request("llama", "whole answer please", 6)
    request.parameters["stream"].bool_param = False
    await call.write(request)
    await call.done_writing()
    responses = [r async for r in call]
    assert len(responses) == 1 and is_final(responses[0].infer_response)
    assert len(response_text(responses[0].infer_response).split()) == 6


async def test_stream_without_stream_parameter_streams_tokens(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    call = stub.ModelStreamInfer()
    await call.write(generate_request("llama", "tokens please", 4))
    await call.done_writing()
    responses = [r async for r in call]
    finals = [is_final(r.infer_response) for r in responses]
    assert finals[-1] and finals.count(True) == 1
    assert counts(responses[-1].infer_response) == (2, 4)


async def test_bad_request_in_stream_reports_error_and_stream_continues(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    call = stub.ModelStreamInfer()
    await call.write(generate_request("gpt", "hi", 3, request_id="bad", stream=True))
    await call.write(pb.ModelInferRequest(model_name="llama", id="empty"))
    await call.write(generate_request("llama", "hi", 5, request_id="good", stream=True))
    await call.done_writing()
    responses = [r async for r in call]
    errors = sorted(r.error_message for r in responses if r.error_message)
    assert len(errors) == 2
    assert errors[0].startswith("INVALID_ARGUMENT") and "text_input" in errors[0]
    assert errors[1].startswith("NOT_FOUND") and "gpt" in errors[1]
    assert errors[1].endswith("(request id 'bad')")
    good = [r.infer_response for r in responses if not r.error_message]
    assert {r.id for r in good} == {"good"} and counts(good[-1]) == (1, 5)
    assert [is_final(r) for r in good].count(True) == 1 and is_final(good[-1])
    assert await call.code() == grpc.StatusCode.OK


async def test_stream_serves_concurrent_requests(
    stub: pb_grpc.GRPCInferenceServiceStub, worker: GpuWorker
) -> None:
    call = stub.ModelStreamInfer()
    for i in range(3):
        await call.write(generate_request("mistral", f"p{i}", 20, request_id=f"r{i}", stream=True))
    await call.done_writing()
    by_id: dict[str, list[pb.ModelInferResponse]] = {}
    async for r in call:
        by_id.setdefault(r.infer_response.id, []).append(r.infer_response)
    assert {
        k: ([is_final(r) for r in v].count(True), is_final(v[-1])) for k, v in by_id.items()
    } == {f"r{i}": (1, True) for i in range(3)}
    assert {k: counts(v[-1]) for k, v in by_id.items()} == {f"r{i}": (1, 20) for i in range(3)}
    assert worker.engine.stats("mistral").requests_succeeded_total == 3


async def test_a_stream_nobody_reads_holds_a_bounded_backlog(worker: GpuWorker) -> None:
    """The caller reads nothing (and, without BDP probing, grants only a 64 KiB window):
    once that is full, the stream's queue stays bounded however much is generated."""
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}", options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer()
        for i in range(3):
            await call.write(generate_request("llama", f"p{i}", 1300, request_id=str(i)))
        for _ in range(500):  # until the engine has generated every token (~4 s at most)
            if worker.engine.stats("llama").tokens_generated_total == 3 * 1300:
                break
            await asyncio.sleep(0.01)
        assert worker.engine.stats("llama").tokens_generated_total == 3 * 1300
        assert 0 < worker.stream_backlog <= STREAM_QUEUE_RESPONSES
        call.cancel()
    for _ in range(100):
        if worker.stream_backlog == 0:
            break
        await asyncio.sleep(0.01)
    assert worker.stream_backlog == 0


# A reader that grants a 1 KiB window and reads nothing yet: the GPU's writer waits on
# it after a few responses while the engine goes on generating.
LAGGING_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


async def lagging_read(worker: GpuWorker, tokens: int) -> list[pb.ModelStreamInferResponse]:
    """A stream of one ``tokens``-token request read only once every token is generated."""
    address = f"127.0.0.1:{worker.port}"
    async with grpc.aio.insecure_channel(address, options=LAGGING_READER) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer()
        await call.write(generate_request("llama", "lag", tokens, request_id="s", stream=True))
        await call.done_writing()
        for _ in range(500):
            if worker.engine.stats("llama").tokens_generated_total == tokens:
                break
            await asyncio.sleep(0.01)
        assert worker.engine.stats("llama").tokens_generated_total == tokens
        return [r async for r in call]


async def test_tokens_that_waited_for_the_writer_go_as_one_and_none_is_lost(
    worker: GpuWorker, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    """As vLLM merges a request's outputs for a consumer that falls behind: fewer
    responses than tokens, the same text in order, the last counts the totals."""
    responses = await lagging_read(worker, 300)
    assert len(responses) < 300
    assert streamed_text(responses) == await unary_words(stub, "lag", 300)
    assert counts(responses[-1].infer_response) == (1, 300)
    assert [is_final(r.infer_response) for r in responses].count(True) == 1
    assert is_final(responses[-1].infer_response)


async def test_a_gpu_that_reports_no_counts_sends_one_response_per_token_however_late() -> None:
    """The tiers above estimate its completion from the responses: none is merged."""
    config = dataclasses.replace(gpu_config(), report_tokens=False)
    worker = GpuWorker(config, region="eu", zone="eu-a", time_scale=0.05)
    await worker.start()
    try:
        responses = await lagging_read(worker, 300)
    finally:
        await worker.stop(0)
    assert len(responses) == 300
    assert [len(response_text(r.infer_response).split()) for r in responses] == [1] * 300


async def test_metrics_parse_and_show_a_running_request(worker: GpuWorker) -> None:
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel,
        aiohttp.ClientSession() as http,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer()
        await call.write(generate_request("llama", "a long one", 3000, stream=True))
        first = await call.read()  # the first token: the request is in the running batch
        assert not first.error_message, first.error_message
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        async with http.get(url) as reply:
            assert reply.status == 200
            assert reply.headers["Content-Type"].startswith("text/plain")
            text = await reply.text()
        call.cancel()
    samples: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) \S+ .+$", line), line
            continue
        assert SAMPLE_RE.match(line), line
        series, value = line.rsplit(" ", 1)
        name, label = series.split("{")
        samples[(name, label.split('"')[1])] = float(value)
    assert samples[("vllm:num_requests_running", "llama")] == 1
    assert samples[("vllm:num_requests_running", "mistral")] == 0
    assert 0 < samples[("vllm:kv_cache_usage_perc", "llama")] <= 1
    assert samples[("vllm:prompt_tokens_total", "llama")] == 3
    assert samples[("vllm:generation_tokens_total", "llama")] >= 1
    assert {name for name, _ in samples} == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "meridian_sim_prefix_cache_hit_tokens_total",
    }
    for _ in range(200):  # the cancelled call's KV is released promptly
        if worker.engine.running == 0:
            break
        await asyncio.sleep(0.01)
    assert worker.engine.kv_cache_usage == 0.0


async def test_stopped_worker_is_not_ready_and_refuses_calls() -> None:
    w = GpuWorker(gpu_config(), region="eu", zone="eu-a", time_scale=0.05)
    await w.start()
    port = w.port
    await w.stop(0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ServerLive(pb.ServerLiveRequest(), timeout=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def zone_config() -> ZoneConfig:
    return ZoneConfig(
        name="eu-a",
        location=GeoPoint(50.1, 8.7),
        endpoint=Endpoint("127.0.0.1", 0),
        address=Endpoint("127.0.0.1", 0),
        gpus=(gpu_config("gpu-a", "A100"), gpu_config("gpu-h", "H100")),
    )


async def test_zone_workers_start_every_gpu() -> None:
    zone = ZoneWorkers(zone_config(), region="eu", time_scale=0.05)
    await zone.start()
    try:
        assert [w.gpu.name for w in zone.workers] == ["gpu-a", "gpu-h"]
        assert len({w.port for w in zone.workers}) == 2 and all(w.port for w in zone.workers)
        for w in zone.workers:
            async with grpc.aio.insecure_channel(w.address) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                call = stub.ModelInfer(generate_request("llama", "hi", 2))
                await call
                assert trailers(await call.trailing_metadata())["x-meridian-route"] == w.gpu.name
    finally:
        await zone.stop(0)


async def test_run_zone_workers_logs_addresses_and_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sim.worker")
    stop = asyncio.Event()
    task = asyncio.create_task(run_zone_workers(zone_config(), "eu", 0.05, stop))
    try:
        for _ in range(500):
            started = [r for r in caplog.records if getattr(r, "event", "") == "worker_started"]
            if len(started) >= 2 or task.done():
                break
            await asyncio.sleep(0.01)
        assert [r.gpu for r in started] == ["gpu-a", "gpu-h"]  # type: ignore[attr-defined]
        lines = [r.getMessage() for r in started]
        assert [line.split()[1] for line in lines] == ["gpu-a", "gpu-h"]
        for line in lines:
            assert re.match(
                r"^worker \S+ listening 127\.0\.0\.1:\d+ metrics 127\.0\.0\.1:\d+$", line
            )
        address = lines[0].split()[3]
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert (await stub.ServerReady(pb.ServerReadyRequest(), timeout=2)).ready
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
