"""Health of servers without grpc.health.v1 (MLServer and other stock V2 servers), against
real grpc.aio servers on loopback that register no health service: the switch to V2
ServerReady/ModelReady is learned once per checker, logged once, and re-checked."""

from __future__ import annotations

import asyncio
import logging
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
from common.request.health import GRPC_HEALTH, V2_READINESS, HealthChecker
from common.request.server import V2_SERVICE

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVER_READY = "/inference.GRPCInferenceService/ServerReady"


class Calls(grpc.aio.ServerInterceptor):
    """Records the method of every call the server receives."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        self.methods.append(details.method)
        return await continuation(details)

    def count(self, method: str) -> int:
        return self.methods.count(method)


class V2(pb_grpc.GRPCInferenceServiceServicer):
    """ServerReady and ModelReady of a stock V2 server."""

    def __init__(self, ready_models: set[str]) -> None:
        self.server_ready = True
        self.ready_models = ready_models
        self.delay_s = 0.0

    async def ServerReady(self, request: object, context: object) -> pb.ServerReadyResponse:
        await asyncio.sleep(self.delay_s)
        return pb.ServerReadyResponse(ready=self.server_ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: object) -> object:
        return pb.ModelReadyResponse(ready=request.name in self.ready_models)


@dataclass
class Server:
    """A V2 server on one loopback port, restartable there with or without grpc.health.v1."""

    port: int = 0
    v2: V2 = field(default_factory=lambda: V2({"a"}))
    calls: Calls = field(default_factory=Calls)
    health: health.aio.HealthServicer | None = None
    server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, with_health: bool = False) -> None:
        self.server = grpc.aio.server(interceptors=[self.calls])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.v2, self.server)
        self.health = None
        if with_health:
            self.health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    made = Server()
    await made.start()
    yield made
    await made.stop()


@pytest.fixture
async def channel(server: Server) -> AsyncIterator[grpc.aio.Channel]:
    opened = grpc.aio.insecure_channel(server.address)
    yield opened
    await opened.close()


def sources(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The ``source`` of every ``health_source`` event logged, in order."""
    return [
        getattr(r, "source", "")
        for r in caplog.records
        if getattr(r, "event", None) == "health_source"
    ]


async def test_check_gpu_learns_v2_readiness_once_and_logs_it_once(
    server: Server, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="common.request.health")
    checker = HealthChecker(channel, name="gpu-mlserver")
    checks = [await checker.check_gpu({"a"}, timeout_s=1.0) for _ in range(3)]
    assert [c.reason for c in checks] == ["ServerReady, 1/1 models ready"] * 3
    assert all(c.healthy and c.answered and c.ready == {"a"} for c in checks)
    assert checker.v2_readiness
    # UNIMPLEMENTED once: grpc.health.v1 is not asked again before the re-check.
    assert server.calls.count(HEALTH_CHECK) == 1
    assert server.calls.count(SERVER_READY) == 3
    assert sources(caplog) == [V2_READINESS]
    record = next(r for r in caplog.records if getattr(r, "event", None) == "health_source")
    assert getattr(record, "child", None) == "gpu-mlserver"


async def test_v2_readiness_marks_down_and_up_like_grpc_health(
    server: Server, channel: grpc.aio.Channel
) -> None:
    """Not ready, no model ready, process gone, back: the same GpuCheck shapes (and so
    the same verdicts in local_lb.readiness) as the grpc.health.v1 path."""
    checker = HealthChecker(channel)
    assert (await checker.check_gpu({"a"}, timeout_s=1.0)).healthy
    server.v2.server_ready = False
    check = await checker.check_gpu({"a"}, timeout_s=1.0)
    assert (check.healthy, check.answered, check.reason) == (False, True, "ServerReady: not ready")
    server.v2.server_ready, server.v2.ready_models = True, set()
    check = await checker.check_gpu({"a"}, timeout_s=1.0)
    assert (check.healthy, check.answered) == (False, True)
    assert check.reason == "ServerReady but no model ready (a: not ready)"
    server.v2.ready_models = {"a"}
    await server.stop()  # the process dies
    started = time.monotonic()
    check = await checker.check_gpu({"a"}, timeout_s=0.5)
    assert time.monotonic() - started < 1.5
    assert (check.healthy, check.answered) == (False, False)
    assert check.reason.startswith(("ServerReady: UNAVAILABLE", "ServerReady: DEADLINE")), check
    await server.start()  # restarted on the same port
    deadline = time.monotonic() + 5.0
    while not (check := await checker.check_gpu({"a"}, timeout_s=0.5)).healthy:
        assert time.monotonic() < deadline, check
        await asyncio.sleep(0.05)
    assert check.reason == "ServerReady, 1/1 models ready"
    assert server.calls.count(HEALTH_CHECK) == 1  # still known to have none


async def test_a_server_ready_that_runs_out_of_time_is_slow_not_a_verdict(
    server: Server, channel: grpc.aio.Channel
) -> None:
    checker = HealthChecker(channel)
    assert (await checker.check_gpu({"a"}, timeout_s=1.0)).healthy
    server.v2.delay_s = 1.0
    check = await checker.check_gpu({"a"}, timeout_s=0.2)
    assert (check.healthy, check.slow, check.answered) == (False, True, False)
    assert check.reason.startswith("ServerReady: DEADLINE_EXCEEDED"), check.reason


async def test_grpc_health_is_asked_again_and_believed_once_it_answers(
    server: Server, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="common.request.health")
    checker = HealthChecker(channel, recheck_s=0.2)
    assert (await checker.check_gpu({"a"}, timeout_s=1.0)).healthy
    await asyncio.sleep(0.25)
    assert (await checker.check_gpu({"a"}, timeout_s=1.0)).healthy  # re-checked: still none
    assert server.calls.count(HEALTH_CHECK) == 2 and checker.v2_readiness
    # Upgraded in place: the same port now serves grpc.health.v1, and says NOT_SERVING.
    await server.stop()
    await server.start(with_health=True)
    assert server.health is not None
    await server.health.set(V2_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.sleep(0.25)
    deadline = time.monotonic() + 5.0
    while (check := await checker.check_gpu({"a"}, timeout_s=0.5)).reason != (
        "health check: NOT_SERVING"
    ):
        assert time.monotonic() < deadline, check
        await asyncio.sleep(0.05)
    assert not checker.v2_readiness
    assert sources(caplog) == [V2_READINESS, GRPC_HEALTH]


class Reports:
    def __init__(self) -> None:
        self.seen: list[tuple[bool, str]] = []

    def __call__(self, healthy: bool, reason: str) -> None:
        self.seen.append((healthy, reason))

    async def until(self, predicate: Callable[[tuple[bool, str]], Any]) -> tuple[bool, str]:
        deadline = time.monotonic() + 3.0
        while not (self.seen and predicate(self.seen[-1])):
            if time.monotonic() > deadline:
                raise AssertionError(f"no such report; saw {self.seen}")
            await asyncio.sleep(0.01)
        return self.seen[-1]


async def test_watch_without_a_health_service_polls_server_ready(
    server: Server, channel: grpc.aio.Channel
) -> None:
    """A tier watching a child with no grpc.health.v1: ServerReady every poll_s, so
    a child that says not ready is reported down (the old watch just ended)."""
    reports = Reports()
    checker = HealthChecker(channel, recheck_s=0.3)
    task = asyncio.create_task(checker.watch(reports, poll_s=0.05))
    try:
        assert await reports.until(lambda r: r[0]) == (True, "")
        server.v2.server_ready = False
        assert await reports.until(lambda r: not r[0]) == (
            False,
            "probe: ServerReady says not ready",
        )
        assert checker.v2_readiness
        # Re-checked every recheck_s: a health service that appears is followed.
        await server.stop()
        await server.start(with_health=True)
        assert server.health is not None
        await server.health.set(V2_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        assert await reports.until(lambda r: r[1].startswith("health:")) == (
            True,
            "health: serving",
        )
        assert not checker.v2_readiness
    finally:
        await cancel_and_wait([task])
