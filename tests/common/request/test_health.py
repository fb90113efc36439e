"""HealthChecker against real grpc.aio servers on loopback, with the real
grpc.health.v1 servicer: one named case per row."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.basics.tasks import cancel_and_wait
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.health import HealthChecker
from common.request.server import V2_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class V2(pb_grpc.GRPCInferenceServiceServicer):
    """ServerReady and ModelReady only; every other RPC is UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.server_ready = True
        self.ready_models: set[str] = set()
        self.model_ready_delay_s = 0.0

    async def ServerReady(self, request: object, context: object) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.server_ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: object) -> object:
        await asyncio.sleep(self.model_ready_delay_s)
        return pb.ModelReadyResponse(ready=request.name in self.ready_models)


@dataclass
class Endpoint:
    address: str
    server: grpc.aio.Server
    v2: V2
    health: health.aio.HealthServicer | None
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def checker(self) -> HealthChecker:
        channel = grpc.aio.insecure_channel(self.address)
        self.channels.append(channel)
        return HealthChecker(channel)


async def serve(with_health: bool = True) -> Endpoint:
    server = grpc.aio.server()
    v2 = V2()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(v2, server)
    servicer = None
    if with_health:
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return Endpoint(f"127.0.0.1:{port}", server, v2, servicer)


Make = Callable[..., Awaitable[Endpoint]]


@pytest.fixture
async def endpoints() -> AsyncIterator[Make]:
    made: list[Endpoint] = []

    async def make(with_health: bool = True) -> Endpoint:
        endpoint = await serve(with_health)
        made.append(endpoint)
        return endpoint

    yield make
    for endpoint in made:
        for channel in endpoint.channels:
            await channel.close()
        await endpoint.server.stop(0)


async def closed_address() -> str:
    """A loopback port nothing listens on any more."""
    endpoint = await serve(with_health=False)
    await endpoint.server.stop(0)
    return endpoint.address


# ------------------------------------------------------------------ check_gpu


@dataclass(frozen=True)
class GpuCase:
    statuses: dict[str, int]  # health service name -> status set on the servicer
    ready: frozenset[str]
    models: frozenset[str]
    healthy: bool
    reason: str
    with_health: bool = True
    answered: bool = True  # the server's own verdict (else its call failed)
    server_ready: bool = True


GPU_CASES = {
    "serving-all-models-ready": GpuCase(
        {V2_SERVICE: SERVING}, frozenset({"a", "b"}), frozenset({"a", "b"}), True,
        "SERVING, 2/2 models ready",
    ),
    "serving-some-models-ready": GpuCase(
        {V2_SERVICE: SERVING}, frozenset({"b"}), frozenset({"a", "b"}), True,
        "SERVING, 1/2 models ready",
    ),
    "unknown-service-falls-back-to-server-wide": GpuCase(
        {"": SERVING}, frozenset({"a"}), frozenset({"a"}), True, "SERVING, 1/1 models ready"
    ),
    "service-not-serving": GpuCase(
        {V2_SERVICE: NOT_SERVING, "": SERVING}, frozenset({"a"}), frozenset({"a"}), False,
        "health check: NOT_SERVING",
    ),
    "server-wide-not-serving": GpuCase(
        {"": NOT_SERVING}, frozenset({"a"}), frozenset({"a"}), False, "health check: NOT_SERVING"
    ),
    "serving-but-no-model-ready": GpuCase(
        {V2_SERVICE: SERVING}, frozenset(), frozenset({"b", "a"}), False,
        "SERVING but no model ready (a: not ready; b: not ready)",
    ),
    "serving-but-no-model-configured": GpuCase(
        {V2_SERVICE: SERVING}, frozenset({"a"}), frozenset(), False,
        "SERVING but no model ready (no models configured)",
    ),
    # Without grpc.health.v1 (MLServer): ServerReady, then ModelReady.
    "no-health-service-ready": GpuCase(
        {}, frozenset({"a"}), frozenset({"a", "b"}), True, "ServerReady, 1/2 models ready",
        with_health=False,
    ),
    "no-health-service-server-not-ready": GpuCase(
        {}, frozenset({"a"}), frozenset({"a"}), False, "ServerReady: not ready",
        with_health=False, server_ready=False,
    ),
    "no-health-service-no-model-ready": GpuCase(
        {}, frozenset(), frozenset({"a"}), False, "ServerReady but no model ready (a: not ready)",
        with_health=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
async def test_check_gpu(case: GpuCase, endpoints: Make) -> None:
    endpoint: Endpoint = await endpoints(case.with_health)
    for service, status in case.statuses.items():
        assert endpoint.health is not None
        await endpoint.health.set(service, status)
    endpoint.v2.ready_models = set(case.ready)
    endpoint.v2.server_ready = case.server_ready
    check = await endpoint.checker().check_gpu(case.models, timeout_s=1.0)
    healthy, reason, ready = check.healthy, check.reason, check.ready
    assert healthy is case.healthy
    assert (check.answered, check.slow) == (case.answered, False)
    if case.reason.endswith(": "):
        assert reason.startswith(case.reason), reason
    else:
        assert reason == case.reason
    assert ready == (case.ready & case.models if healthy else frozenset())


async def test_check_gpu_of_a_dead_endpoint_is_unavailable_within_the_timeout() -> None:
    channel = grpc.aio.insecure_channel(await closed_address())
    try:
        started = time.monotonic()
        check = await HealthChecker(channel).check_gpu({"a"}, timeout_s=0.5)
        assert time.monotonic() - started < 1.5
    finally:
        await channel.close()
    assert (check.healthy, check.ready, check.answered) == (False, frozenset(), False)
    assert check.reason.startswith(("health check: UNAVAILABLE", "health check: DEADLINE_EXCEEDED"))


class SlowHealth(health.aio.HealthServicer):
    """grpc.health.v1 whose Check answers only after ``delay_s``."""

    delay_s = 1.0

    async def Check(self, request: Any, context: Any) -> Any:
        await asyncio.sleep(self.delay_s)
        return await super().Check(request, context)


async def test_check_gpu_that_runs_out_of_time_is_slow_not_a_verdict() -> None:
    server = grpc.aio.server()
    servicer = SlowHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        await servicer.set("", SERVING)
        check = await HealthChecker(channel).check_gpu({"a"}, timeout_s=0.2)
    finally:
        await channel.close()
        await server.stop(0)
    assert (check.healthy, check.slow, check.answered) == (False, True, False)
    assert check.reason.startswith("health check: DEADLINE_EXCEEDED"), check.reason


async def test_check_gpu_whose_model_ready_runs_out_of_time_is_slow(endpoints: Make) -> None:
    endpoint: Endpoint = await endpoints()
    assert endpoint.health is not None
    await endpoint.health.set(V2_SERVICE, SERVING)
    endpoint.v2.ready_models = {"a"}
    endpoint.v2.model_ready_delay_s = 1.0
    check = await endpoint.checker().check_gpu({"a"}, timeout_s=0.2)
    assert (check.healthy, check.slow, check.answered) == (False, True, False)
    assert check.reason == "SERVING but no model ready (a: DEADLINE_EXCEEDED)"


# ------------------------------------------------------------------ server_ready


@pytest.mark.parametrize(
    ("ready", "expected"),
    [(True, (True, "")), (False, (False, "probe: ServerReady says not ready"))],
    ids=["ready", "not-ready"],
)
async def test_server_ready(
    ready: bool, expected: tuple[bool, str], endpoints: Make
) -> None:
    endpoint: Endpoint = await endpoints()
    endpoint.v2.server_ready = ready
    assert await endpoint.checker().server_ready(timeout_s=1.0) == expected


async def test_server_ready_of_a_dead_endpoint() -> None:
    channel = grpc.aio.insecure_channel(await closed_address())
    try:
        healthy, reason = await HealthChecker(channel).server_ready(timeout_s=0.5)
    finally:
        await channel.close()
    assert healthy is False
    assert reason.startswith(("probe: UNAVAILABLE", "probe: DEADLINE_EXCEEDED")), reason


# ------------------------------------------------------------------ watch


class Reports:
    def __init__(self) -> None:
        self.seen: list[tuple[bool, str]] = []

    def __call__(self, healthy: bool, reason: str) -> None:
        self.seen.append((healthy, reason))

    async def until(self, predicate: Callable[[tuple[bool, str]], bool]) -> tuple[bool, str]:
        deadline = time.monotonic() + 3.0
        while not (self.seen and predicate(self.seen[-1])):
            if time.monotonic() > deadline:
                raise AssertionError(f"no such report; saw {self.seen}")
            await asyncio.sleep(0.01)
        return self.seen[-1]


async def test_watch_reports_every_transition_and_a_broken_stream(
    endpoints: Make,
) -> None:
    endpoint: Endpoint = await endpoints()
    assert endpoint.health is not None
    await endpoint.health.set(V2_SERVICE, SERVING)
    reports = Reports()
    task = asyncio.create_task(endpoint.checker().watch(reports))
    try:
        assert await reports.until(lambda r: r[0]) == (True, "health: serving")
        await endpoint.health.set(V2_SERVICE, NOT_SERVING)
        assert await reports.until(lambda r: not r[0]) == (False, "health: not serving")
        await endpoint.health.set(V2_SERVICE, SERVING)
        await reports.until(lambda r: r[0])
        await endpoint.server.stop(0)  # the process "dies": the stream breaks
        _, reason = await reports.until(lambda r: not r[0])
        assert reason.startswith("health: ") and reason != "health: not serving", reason
        assert not task.done()  # it keeps re-opening the watch, with back-off
    finally:
        await cancel_and_wait([task])
    assert task.done()


async def test_watch_ends_without_a_health_service(endpoints: Make) -> None:
    endpoint: Endpoint = await endpoints(with_health=False)
    reports = Reports()
    await asyncio.wait_for(endpoint.checker().watch(reports), timeout=3.0)
    assert reports.seen == []


async def test_watch_backs_off_while_the_endpoint_is_down() -> None:
    channel = grpc.aio.insecure_channel(await closed_address())
    reports = Reports()
    task = asyncio.create_task(HealthChecker(channel).watch(reports))
    try:
        await asyncio.sleep(0.65)
    finally:
        await cancel_and_wait([task])
        await channel.close()
    # Re-opened after 0.1, 0.2, 0.4 s: about four failures in 0.65 s, never dozens.
    assert 2 <= len(reports.seen) <= 5, reports.seen
    assert all(not healthy for healthy, _ in reports.seen)
