"""Load samples: parsers and LoadBook (pure), BackendMonitor against real servers on loopback."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.health import GpuCheck
from common.request.v2 import generate_request
from local_lb.load import BackendMonitor, MonitoredGpu, jittered
from local_lb.load_book import LoadBook, LoadSample, parse_load_trailer, parse_prometheus_load
from sim.worker import GpuWorker
from tests.until import until

INTERVAL_S = 0.1
MAX_AGE_S = 3 * INTERVAL_S

# ------------------------------------------------------------------ parse_prometheus_load

VLLM_TWO_MODELS = """\
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 3
vllm:num_requests_running{model_name="mistral"} 2.0
# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 1
vllm:num_requests_waiting{model_name="mistral"} 4
vllm:kv_cache_usage_perc{model_name="llama"} 0.25
vllm:kv_cache_usage_perc{model_name="mistral"} 0.25
vllm:generation_tokens_total{model_name="llama"} 12345
"""


def test_vllm_counts_are_summed_over_models() -> None:
    assert parse_prometheus_load(VLLM_TWO_MODELS) == (5.0, 5.0, 0.25)


def test_kv_usage_is_one_gpu_wide_fraction_not_a_sum() -> None:
    text = (
        'vllm:kv_cache_usage_perc{model_name="a"} 0.2\n'
        'vllm:kv_cache_usage_perc{model_name="b"} 0.5\n'
    )
    assert parse_prometheus_load(text) == (0.0, 0.0, 0.5)


def test_older_vllm_gpu_cache_name() -> None:
    text = (
        'vllm:num_requests_running{model_name="m"} 1\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.7\n'
    )
    assert parse_prometheus_load(text) == (1.0, 0.0, 0.7)


def test_current_kv_name_wins_over_older() -> None:
    text = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n"
    assert parse_prometheus_load(text) == (0.0, 0.0, 0.1)


def test_triton_pending_count_is_waiting() -> None:
    text = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="resnet",version="1"} 2
nv_inference_pending_request_count{model="bert",version="1"} 3
nv_inference_exec_count{model="bert",version="1"} 900
nv_gpu_utilization{gpu_uuid="GPU-1"} 0.5
"""
    assert parse_prometheus_load(text) == (0.0, 5.0, None)


def test_garbage_lines_are_skipped() -> None:
    text = """\
vllm:num_requests_running{model_name="m"} 2
vllm:num_requests_running{model_name="n" 7
vllm:num_requests_running{model_name="o"} seven
vllm:num_requests_running{model_name="p"} NaN
vllm:num_requests_running{model_name="q"} -4
vllm:num_requests_running{model_name="r"} +Inf
vllm:num_requests_running{model_name="s"} 1 2 3
vllm:num_requests_running
{model_name="t"} 9
\x00\xff}{"{{ = ,,
vllm:num_requests_waiting{model_name="m"} 1 1712345678000
"""
    assert parse_prometheus_load(text) == (2.0, 1.0, None)


def test_quoted_labels_with_commas_spaces_braces_and_escapes() -> None:
    text = (
        'vllm:num_requests_running{model_name="a, b} c",x="say \\"hi\\", ok"} 2\n'
        'vllm:num_requests_running{ model_name = "back\\\\slash\\n" , } 3\n'
        "vllm:num_requests_running{} 1\n"
    )
    assert parse_prometheus_load(text) == (6.0, 0.0, None)


@pytest.mark.parametrize(
    "text",
    ["", "# only comments\n# TYPE x gauge\n", "other_metric 3\n", "vllm:unknown 1\n", "<html>"],
)
def test_no_known_metric_is_none(text: str) -> None:
    assert parse_prometheus_load(text) is None


def test_pathological_line_is_fast() -> None:
    line = "vllm:num_requests_running{" + 'a="x",' * 20_000 + " " * 20_000 + "oops\n"
    started = time.perf_counter()
    assert parse_prometheus_load(line * 5) is None
    assert time.perf_counter() - started < 1.0


# ------------------------------------------------------------------ parse_load_trailer


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("running=3,waiting=1,kv=0.250", (3.0, 1.0, 0.25)),
        ("kv=1.000,waiting=0,running=0", (0.0, 0.0, 1.0)),
        ("running=2, waiting=5, kv=0.5, future=9", (2.0, 5.0, 0.5)),
        ("running= 4,waiting=2 ,kv=0.125", (4.0, 2.0, 0.125)),  # spaces around numbers
        (" running=4,waiting=2,kv=0.125", (4.0, 2.0, 0.125)),
    ],
)
def test_trailer_good(value: str, expected: tuple[float, float, float]) -> None:
    assert parse_load_trailer(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        "running=3,waiting=1",
        "running=x,waiting=1,kv=0.2",
        "running=3,,waiting=1,kv=0.2",
        "running=3,waiting=1,kv=0.2,running=4",
        "running=-1,waiting=1,kv=0.2",
        "running=nan,waiting=1,kv=0.2",
        "running=3,waiting=1,kv=inf",
        "running=3=4,waiting=1,kv=0.2",
        "running=,waiting=1,kv=0.2",
        "=3,waiting=1,kv=0.2",
    ],
)
def test_trailer_malformed_is_none(value: str) -> None:
    assert parse_load_trailer(value) is None


# ------------------------------------------------------------------ LoadBook


def sample(taken_at: float, waiting: float = 2.0, source: str = "metrics") -> LoadSample:
    return LoadSample(
        running=1.0, waiting=waiting, kv_cache_usage=0.1, taken_at=taken_at, source=source
    )


def test_fresh_sample_is_returned_with_its_age() -> None:
    book = LoadBook()
    book.update("g", sample(10.0))
    got = book.get("g", now=10.4, max_age_s=0.5)
    assert got is not None and got.age(10.4) == pytest.approx(0.4)


def test_stale_sample_is_unknown_never_zero() -> None:
    book = LoadBook()
    book.update("g", sample(10.0, waiting=0.0))
    assert book.get("g", now=10.6, max_age_s=0.5) is None
    assert book.get("missing", now=10.6, max_age_s=0.5) is None


def test_conservative_waiting_uses_fallback_when_stale_or_missing() -> None:
    book = LoadBook()
    book.update("g", sample(10.0, waiting=0.0))
    assert book.conservative_waiting("g", 10.2, 0.5, fallback=7.0) == 0.0
    assert book.conservative_waiting("g", 11.0, 0.5, fallback=7.0) == 7.0
    assert book.conservative_waiting("missing", 11.0, 0.5, fallback=3.0) == 3.0


def test_newer_sample_wins_whatever_the_arrival_order() -> None:
    book = LoadBook()
    book.update("g", sample(5.0, waiting=1.0))
    book.update("g", sample(4.0, waiting=9.0))  # arrived late: older
    got = book.get("g", 5.0, 1.0)
    assert got is not None and got.waiting == 1.0
    book.update("g", sample(6.0, waiting=3.0, source="trailer"))
    got = book.get("g", 6.0, 1.0)
    assert got is not None and (got.waiting, got.source) == (3.0, "trailer")


def test_record_trailer() -> None:
    book = LoadBook()
    trailers: list[tuple[str, str | bytes]] = [
        ("x-meridian-route", "g"),
        ("x-meridian-load", b"running=2,waiting=3,kv=0.500"),
    ]
    recorded = book.record_trailer("g", trailers, now=1.0)
    assert recorded == LoadSample(2.0, 3.0, 0.5, taken_at=1.0, source="trailer")
    assert book.get("g", 1.0, 0.5) == recorded
    assert book.record_trailer("g", [("x-meridian-load", "bad")], now=2.0) is None
    assert book.record_trailer("g", None, now=2.0) is None
    assert book.get("g", 1.0, 0.5) == recorded  # a malformed trailer changes nothing


def test_jitter_stays_within_ten_percent_and_varies() -> None:
    rng = random.Random(7)
    delays = [jittered(0.5, rng) for _ in range(1000)]
    assert all(0.45 <= d <= 0.55 for d in delays)
    assert max(delays) - min(delays) > 0.08


# ------------------------------------------------------------------ BackendMonitor

Health = list[tuple[float, str, bool, str]]


class Recorder:
    """``on_health`` that keeps every call with its time."""

    def __init__(self) -> None:
        self.calls: Health = []

    def __call__(self, name: str, check: GpuCheck) -> None:
        self.calls.append((time.monotonic(), name, check.healthy, check.reason))

    def last(self, name: str) -> tuple[bool, str] | None:
        for _, n, healthy, reason in reversed(self.calls):
            if n == name:
                return healthy, reason
        return None

    def healthy(self, name: str) -> bool | None:
        last = self.last(name)
        return None if last is None else last[0]


def gpu_config(name: str = "gpu-0") -> GpuConfig:
    return GpuConfig(
        name=name,
        endpoint=Endpoint("127.0.0.1", 0),
        metrics_endpoint=Endpoint("127.0.0.1", 0),
        hardware="A100",
        models=("llama", "mistral"),
    )


def monitored(worker: GpuWorker, metrics_url: str | None = "") -> MonitoredGpu:
    if metrics_url == "":
        metrics_url = f"http://{worker.metrics_address}/metrics"
    return MonitoredGpu(
        name=worker.gpu.name,
        address=worker.address,
        models=frozenset(worker.gpu.models),
        metrics_url=metrics_url,
    )


def poll_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("load-poll:")]


@pytest.fixture
async def worker() -> AsyncIterator[GpuWorker]:
    w = GpuWorker(gpu_config(), region="eu", zone="eu-a", time_scale=0.05)
    await w.start()
    try:
        yield w
    finally:
        await w.stop(0)


MonitorFactory = Callable[..., Awaitable[BackendMonitor]]


@pytest.fixture
async def make_monitor() -> AsyncIterator[MonitorFactory]:
    """Start monitors; each is stopped at teardown, and no poll task may outlive it."""
    monitors: list[BackendMonitor] = []

    async def make(gpus: list[MonitoredGpu], on_health: Recorder) -> BackendMonitor:
        monitor = BackendMonitor(gpus, on_health=on_health, interval_s=INTERVAL_S)
        await monitor.start()
        monitors.append(monitor)
        return monitor

    try:
        yield make
    finally:
        for monitor in monitors:
            await monitor.stop()
    assert poll_tasks() == []


async def test_monitor_reads_load_and_health_of_a_real_gpu(
    worker: GpuWorker, make_monitor: MonitorFactory
) -> None:
    health_calls = Recorder()
    monitor = await make_monitor([monitored(worker)], health_calls)
    name = worker.gpu.name

    await until(lambda: monitor.book.get(name, time.monotonic(), MAX_AGE_S) is not None)
    got = monitor.book.get(name, time.monotonic(), MAX_AGE_S)
    assert got is not None and got.source == "metrics"
    assert (got.running, got.waiting, got.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert got.age(time.monotonic()) < 2 * INTERVAL_S
    await until(lambda: health_calls.last(name) is not None)
    assert health_calls.last(name) == (True, "SERVING, 2/2 models ready")
    assert monitor.ready_models(name) == frozenset({"llama", "mistral"})
    assert monitor.ready_models("unknown") == frozenset()

    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelInfer(generate_request("llama", "a long story please", 8192))
        try:

            def busy() -> bool:
                s = monitor.book.get(name, time.monotonic(), MAX_AGE_S)
                return s is not None and s.running >= 1

            await until(busy, what="running >= 1 while a long request runs")
            busy_sample = monitor.book.get(name, time.monotonic(), MAX_AGE_S)
            assert busy_sample is not None and busy_sample.kv_cache_usage
        finally:
            call.cancel()

        # A real response's trailing metadata feeds the same book.
        short = stub.ModelInfer(generate_request("llama", "hi", 2))
        await short
        recorded = monitor.book.record_trailer(
            name, await short.trailing_metadata(), time.monotonic()
        )
        assert recorded is not None and recorded.source == "trailer"


async def test_monitor_sees_a_stopped_gpu_go_unhealthy_and_its_load_go_stale(
    worker: GpuWorker, make_monitor: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    health_calls = Recorder()
    monitor = await make_monitor([monitored(worker)], health_calls)
    name = worker.gpu.name
    await until(lambda: health_calls.last(name) is not None)
    await until(lambda: monitor.book.get(name, time.monotonic(), MAX_AGE_S) is not None)

    caplog.set_level(logging.WARNING, logger="local_lb.load")
    await worker.stop(0)
    stopped = time.monotonic()
    await until(lambda: health_calls.healthy(name) is False, what="health False")
    first_down = next(t for t, n, ok, _ in health_calls.calls if n == name and not ok)
    assert first_down - stopped <= 2 * INTERVAL_S * 1.1 + 0.2
    assert monitor.ready_models(name) == frozenset()
    # A poll in flight when the server stopped ends CANCELLED; the ones after it find nothing
    # listening, and the reason says so.
    await until(
        lambda: (health_calls.last(name) or (None, ""))[1].startswith("health check: UNAVAILABLE"),
        what="a poll that finds the port closed",
    )
    healthy, reason = health_calls.last(name) or (None, "")
    assert healthy is False, reason

    await until(lambda: monitor.book.get(name, time.monotonic(), MAX_AGE_S) is None)
    last = monitor.book._samples[name]
    assert last.taken_at <= stopped  # nothing recorded after the stop, not even zeros
    calls_now = len(health_calls.calls)
    await until(lambda: len(health_calls.calls) >= calls_now + 3, what="more polls")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and name in r.message]
    assert len(warnings) == 1, [r.message for r in warnings]


@pytest.fixture
async def odd_metrics() -> AsyncIterator[str]:
    """An HTTP server with broken metrics endpoints; yields its base URL."""

    async def error(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=b"\x00\xff}{ not prometheus\nvllm:num_requests_running{ 3\n")

    released = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await released.wait()  # longer than any scrape timeout, until teardown
        return web.Response(text="vllm:num_requests_running 1\n")

    app = web.Application()
    app.router.add_get("/500", error)
    app.router.add_get("/garbage", garbage)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        released.set()
        await runner.cleanup()


async def test_broken_metrics_leave_load_unknown_and_health_untouched(
    worker: GpuWorker, odd_metrics: str, make_monitor: MonitorFactory
) -> None:
    health_calls = Recorder()
    gpus = [
        MonitoredGpu(f"gpu-{path}", worker.address, frozenset({"llama"}), f"{odd_metrics}/{path}")
        for path in ("500", "garbage", "slow", "absent")
    ] + [
        MonitoredGpu(
            "gpu-closed-port", worker.address, frozenset({"llama"}), "http://127.0.0.1:1/m"
        )
    ]
    gpus.append(MonitoredGpu("gpu-no-metrics", worker.address, frozenset({"llama"}), None))
    monitor = await make_monitor(gpus, health_calls)

    await until(lambda: len(health_calls.calls) >= 4 * len(gpus), what="several polls")
    # Every GPU's health check says SERVING whatever its metrics do. A poll's timeout is
    # INTERVAL_S (0.1 s), which a loaded CI machine can miss once; a GPU whose health the
    # broken metrics touched would never settle there.
    serving = (True, "SERVING, 1/1 models ready")
    await until(
        lambda: all(health_calls.last(gpu.name) == serving for gpu in gpus),
        what="every GPU's health SERVING",
    )
    for gpu in gpus:
        assert monitor.book.get(gpu.name, time.monotonic(), 1e9) is None, gpu.name


class FakeV2(pb_grpc.GRPCInferenceServiceServicer):
    """Only ModelReady, for servers whose health service differs from the emulated GPU's."""

    def __init__(self, ready: set[str]) -> None:
        self.ready = ready

    async def ModelReady(self, request: pb.ModelReadyRequest, context: object) -> object:
        return pb.ModelReadyResponse(ready=request.name in self.ready)


@pytest.fixture
async def fake_server() -> AsyncIterator[tuple[str, health.aio.HealthServicer, FakeV2]]:
    """A real gRPC server whose health knows only "" (no V2 service name)."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    v2 = FakeV2({"llama"})
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(v2, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        yield f"127.0.0.1:{port}", servicer, v2
    finally:
        await server.stop(0)


async def test_health_falls_back_to_server_wide_status_and_needs_a_ready_model(
    fake_server: tuple[str, health.aio.HealthServicer, FakeV2], make_monitor: MonitorFactory
) -> None:
    address, servicer, v2 = fake_server
    health_calls = Recorder()
    gpu = MonitoredGpu("triton", address, frozenset({"llama", "bert"}))
    monitor = await make_monitor([gpu], health_calls)
    await until(lambda: health_calls.last("triton") == (True, "SERVING, 1/2 models ready"))
    assert monitor.ready_models("triton") == frozenset({"llama"})

    v2.ready.clear()
    await until(lambda: health_calls.healthy("triton") is False)
    assert health_calls.last("triton") == (
        False,
        "SERVING but no model ready (bert: not ready; llama: not ready)",
    )
    assert monitor.ready_models("triton") == frozenset()

    v2.ready.add("bert")
    await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await until(lambda: health_calls.last("triton") == (False, "health check: NOT_SERVING"))
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await until(lambda: health_calls.last("triton") == (True, "SERVING, 1/2 models ready"))
    assert monitor.ready_models("triton") == frozenset({"bert"})


async def test_monitor_validates_its_settings() -> None:
    gpu = MonitoredGpu("g", "127.0.0.1:1", frozenset({"m"}))
    with pytest.raises(ValueError, match="unique"):
        BackendMonitor([gpu, gpu], on_health=Recorder())
    with pytest.raises(ValueError, match="interval_s"):
        BackendMonitor([gpu], on_health=Recorder(), interval_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        BackendMonitor([gpu], on_health=Recorder(), interval_s=0.5, timeout_s=1.0)


def test_monitored_gpu_from_config() -> None:
    cfg = GpuConfig(
        name="g",
        endpoint=Endpoint("10.0.0.1", 8001),
        metrics_endpoint=Endpoint("10.0.0.1", 8002),
        hardware="H100",
        models=("llama",),
    )
    assert MonitoredGpu.from_config(cfg) == MonitoredGpu(
        "g", "10.0.0.1:8001", frozenset({"llama"}), "http://10.0.0.1:8002/metrics"
    )


async def test_a_monitor_stopped_mid_poll_leaves_no_step_unawaited(worker: GpuWorker) -> None:
    """Stopped when a poll has just asked for its scrape and check but neither has run,
    the monitor leaves no coroutine that was made and never awaited (Python warns of
    each when it is collected)."""
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            monitor = BackendMonitor([monitored(worker)], on_health=Recorder(), interval_s=1.0)
            await monitor.start()
            await asyncio.sleep(0)  # the poll loop runs up to its gather, no further
            await monitor.stop()
        gc.collect()
    unawaited = [str(w.message) for w in caught if "never awaited" in str(w.message)]
    assert unawaited == []
