"""Passive health: a GPU serving traffic is not probed while its successes are recent,
an idle one is, and one that dies under traffic is checked within an interval of its
last success. A real OpenAI HTTP server on loopback counts what the monitor asks of it;
the test's own requests to it are the traffic (``up_at`` is when one last succeeded,
as ``GpuReadiness.up_at`` tells the real tier)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from aiohttp import web

from common.basics.redis_embed import free_port
from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.health import GpuCheck
from common.request.v2 import generate_request
from local_lb.load import CHECK_AT_LEAST_EVERY, BackendMonitor, MonitoredGpu
from local_lb.load_book import LoadSample
from local_lb.readiness import GpuReadiness
from sim.worker import GpuWorker
from tests.local_lb.test_readiness import SERVING, zone
from tests.until import until

INTERVAL_S = 0.1
METRICS = b'vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting 0\n'


class OpenAIGpu:
    """A real HTTP server answering as vLLM does, counting every path asked."""

    def __init__(self) -> None:
        self.port = free_port()
        self.asked: Counter[str] = Counter()
        self.runner: web.AppRunner | None = None

    async def _answer(self, request: web.Request) -> web.Response:
        self.asked[request.path] += 1
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m"}]})
        if request.path == "/metrics":
            return web.Response(body=METRICS)
        return web.json_response({"ok": True})

    async def start(self) -> None:
        app = web.Application()
        for path in ("/health", "/v1/models", "/metrics", "/v1/completions"):
            app.router.add_route("*", path, self._answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class Traffic:
    """Requests to the GPU every ``gap_s``; ``up_at`` is when one last succeeded."""

    def __init__(self, gpu: OpenAIGpu) -> None:
        self.gpu = gpu
        self.last_ok = float("-inf")

    def up_at(self, name: str) -> float:
        return self.last_ok

    async def run(self, seconds: float, gap_s: float = 0.02) -> None:
        url = f"http://127.0.0.1:{self.gpu.port}/v1/completions"
        end = time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < end:
                try:
                    async with session.post(url, json={"model": "m"}) as response:
                        if response.status == 200:
                            self.last_ok = time.monotonic()
                except aiohttp.ClientError:
                    pass  # the GPU is gone: no success, so no evidence
                await asyncio.sleep(gap_s)


class Checks:
    """``on_health``: every check with the time it ended."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, GpuCheck]] = []

    def __call__(self, name: str, check: GpuCheck) -> None:
        self.calls.append((time.monotonic(), check))


@pytest.fixture
async def gpu() -> AsyncIterator[OpenAIGpu]:
    server = OpenAIGpu()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def traffic(gpu: OpenAIGpu) -> Traffic:
    return Traffic(gpu)


@pytest.fixture
async def monitor(gpu: OpenAIGpu, traffic: Traffic) -> AsyncIterator[tuple[BackendMonitor, Checks]]:
    checks = Checks()
    watched = MonitoredGpu(
        name="g0",
        address=f"127.0.0.1:{gpu.port}",
        models=frozenset({"m"}),
        metrics_url=f"http://127.0.0.1:{gpu.port}/metrics",
        protocol="openai",
    )
    made = BackendMonitor([watched], on_health=checks, up_at=traffic.up_at, interval_s=INTERVAL_S)
    await made.start()
    try:
        await until(lambda: len(checks.calls) >= 1, what="the first check")
        yield made, checks
    finally:
        await made.stop()
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("load-poll:")] == []


async def test_a_gpu_serving_traffic_is_not_probed_while_its_successes_are_recent(
    gpu: OpenAIGpu, traffic: Traffic, monitor: tuple[BackendMonitor, Checks]
) -> None:
    watcher, _ = monitor
    seconds = 1.5
    load = asyncio.create_task(traffic.run(seconds))
    await asyncio.sleep(2 * INTERVAL_S)  # the check in flight when traffic began ends
    before = Counter(gpu.asked)
    await load
    during = gpu.asked - before
    rounds = (seconds - 2 * INTERVAL_S) / INTERVAL_S
    # Every round's check was stood in for by a success but the one forced every
    # CHECK_AT_LEAST_EVERY intervals; with no trailer the load is still scraped.
    assert during["/health"] <= rounds / CHECK_AT_LEAST_EVERY + 1, during
    assert during["/metrics"] >= rounds / 2, during
    assert watcher.skipped("g0")[0] >= rounds / 2


async def test_a_gpu_reporting_its_load_is_not_scraped(
    gpu: OpenAIGpu, monitor: tuple[BackendMonitor, Checks]
) -> None:
    watcher, _ = monitor
    before = Counter(gpu.asked)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # its answers carry its load, as the trailer does
        sample = LoadSample(0.0, 0.0, 0.1, taken_at=time.monotonic(), source="trailer")
        watcher.book.update("g0", sample)
        await asyncio.sleep(0.02)
    during = gpu.asked - before
    assert during["/metrics"] <= 1, during
    assert during["/health"] >= 5, during  # no request succeeded: still checked


async def test_an_idle_gpu_is_still_checked_every_interval(
    gpu: OpenAIGpu, monitor: tuple[BackendMonitor, Checks]
) -> None:
    watcher, checks = monitor
    before, calls = Counter(gpu.asked), len(checks.calls)
    await asyncio.sleep(1.0)
    during = gpu.asked - before
    assert during["/health"] >= 6 and during["/metrics"] >= 6, during
    assert len(checks.calls) - calls >= 6
    assert watcher.skipped("g0") == (0, 0)


async def test_a_gpu_that_dies_under_traffic_is_checked_within_an_interval_of_its_last_success(
    gpu: OpenAIGpu, traffic: Traffic, monitor: tuple[BackendMonitor, Checks]
) -> None:
    _, checks = monitor
    load = asyncio.create_task(traffic.run(3.0))
    try:
        await asyncio.sleep(0.5)
        await gpu.stop()  # requests fail from now on: no more evidence
        stopped = time.monotonic()
        await until(lambda: any(not c.healthy for t, c in checks.calls if t > stopped))
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    down_at = next(t for t, c in checks.calls if t > stopped and not c.healthy)
    # The bound without passive health too: a check within interval x 1.1 (jitter) of
    # the last evidence, plus the check's own time on a loaded test machine.
    assert traffic.last_ok > stopped - 2 * INTERVAL_S  # it did serve until it died
    assert down_at - traffic.last_ok <= 1.1 * INTERVAL_S + 0.15


def test_up_at_is_the_last_success_of_a_ready_gpu_with_no_failure_since() -> None:
    z = zone()
    readiness: GpuReadiness = z.readiness
    assert readiness.up_at("g0") == float("-inf")  # never served
    z.clock.now = 5.0
    readiness.request_succeeded(z.gpu("g0"))
    assert readiness.up_at("g0") == 5.0
    z.clock.now = 6.0
    readiness.request_failed(z.gpu("g0"), "UNAVAILABLE: reset")
    assert readiness.up_at("g0") == float("-inf")  # the failure is newer
    readiness.probed("g0", SERVING)
    z.clock.now = 7.0
    readiness.request_succeeded(z.gpu("g0"))
    assert readiness.up_at("g0") == 7.0


@pytest.fixture
async def v2_gpu() -> AsyncIterator[GpuWorker]:
    config = GpuConfig(
        name="v2",
        endpoint=Endpoint("127.0.0.1", 0),
        metrics_endpoint=Endpoint("127.0.0.1", 0),
        hardware="A100",
        models=("llama",),
    )
    worker = GpuWorker(config, region="eu", zone="eu-a", time_scale=0.05)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop(0)


async def test_a_v2_gpu_serving_traffic_is_neither_checked_nor_scraped(v2_gpu: GpuWorker) -> None:
    """The gRPC path: each answer's trailer is its load and its success the evidence, as
    the tier's balancer records them; only the check forced every CHECK_AT_LEAST_EVERY
    intervals is sent."""
    checks, last_ok = Checks(), [float("-inf")]
    watched = MonitoredGpu(
        name="v2",
        address=v2_gpu.address,
        models=frozenset({"llama"}),
        metrics_url=f"http://{v2_gpu.metrics_address}/metrics",
    )
    made = BackendMonitor(
        [watched], on_health=checks, up_at=lambda name: last_ok[0], interval_s=INTERVAL_S
    )
    await made.start()
    try:
        await until(lambda: len(checks.calls) >= 1, what="the first check")
        async with grpc.aio.insecure_channel(v2_gpu.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                call = stub.ModelInfer(generate_request("llama", "hi", 2))
                await call
                made.book.record_trailer("v2", await call.trailing_metadata(), time.monotonic())
                last_ok[0] = time.monotonic()
                if made.skipped("v2") == (0, 0):
                    first, calls = time.monotonic(), len(checks.calls)
                await asyncio.sleep(0.02)
        checked = len(checks.calls) - calls
        skipped_checks, skipped_scrapes = made.skipped("v2")
    finally:
        await made.stop()
    rounds = (end - first) / INTERVAL_S
    assert checked <= rounds / CHECK_AT_LEAST_EVERY + 1, (checked, rounds)
    assert skipped_checks >= rounds / 2 and skipped_scrapes >= rounds / 2
