"""common.operations.reload.reload_children: a reloaded topology applied to a tier's
children, over real gRPC child servers on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.basics.geo import GeoPoint
from common.basics.redis_embed import free_port
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.operations.reload import reload_children
from common.request.children import Child, ChildSet
from common.request.server import V2_SERVICE
from tests.until import until

M = "demo-llm"
ServerFactory = Callable[[], Awaitable[Endpoint]]
SetFactory = Callable[..., Awaitable[ChildSet]]


class Ready(pb_grpc.GRPCInferenceServiceServicer):
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)


@pytest.fixture
async def child_server() -> AsyncIterator[ServerFactory]:
    """Real child tiers: V2 ServerReady and grpc.health.v1 SERVING, on loopback ports."""
    servers: list[grpc.aio.Server] = []

    async def start() -> Endpoint:
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Ready(), server)
        checker = health.aio.HealthServicer()
        await checker.set(V2_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return Endpoint("127.0.0.1", port)

    try:
        yield start
    finally:
        for server in servers:
            await server.stop(None)


@pytest.fixture
async def child_sets() -> AsyncIterator[SetFactory]:
    made: list[ChildSet] = []

    async def make(*children: Child, probe: bool = True) -> ChildSet:
        children_set = ChildSet(children, probe_interval_s=0.2, summary_ttl_s=1.5, probe=probe)
        await children_set.start()
        made.append(children_set)
        return children_set

    try:
        yield make
    finally:
        for children_set in made:
            await children_set.stop()


def child(name: str, endpoint: Endpoint, models: frozenset[str] = frozenset({M})) -> Child:
    return Child(name=name, endpoint=endpoint, models=models, location=GeoPoint(1.0, 2.0))


class Gone:
    """``on_gone`` that records which children it was called for."""

    def __init__(self, fail: bool = False) -> None:
        self.names: list[str] = []
        self.fail = fail

    async def __call__(self, gone: Child) -> None:
        self.names.append(gone.name)
        if self.fail:
            raise RuntimeError(f"clean-up of {gone.name} broke")


# ------------------------------------------------------------------ nothing changed


async def test_same_children_report_nothing(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    endpoint = await child_server()
    children = await child_sets(child("a", endpoint))
    report = await reload_children(children, [child("a", endpoint)])
    assert (list(report.added), list(report.removed)) == ([], [])
    assert (list(report.changed), list(report.not_applied)) == ([], [])
    assert [c.name for c in children] == ["a"]


# ------------------------------------------------------------------ added


async def test_added_child_is_probed_and_watched_before_it_is_routed_to(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a, b = await child_server(), await child_server()
    children = await child_sets(child("a", a))
    added: list[str] = []
    report = await reload_children(
        children, [child("a", a), child("b", b)], on_added=lambda c: added.append(c.name)
    )
    assert list(report.added) == ["b"] and added == ["b"]
    new = children.by_name["b"]
    assert new.channel is not None and new.stub is not None
    assert new.healthy and new.last_error == ""  # its first health answer came in add()


async def test_added_child_that_does_not_answer_stays_down(child_sets: SetFactory) -> None:
    nowhere = Endpoint("127.0.0.1", free_port())
    children = await child_sets()
    report = await reload_children(children, [child("x", nowhere)])
    assert list(report.added) == ["x"]
    assert not children.by_name["x"].healthy
    assert "UNAVAILABLE" in children.by_name["x"].last_error


async def test_added_child_without_probing_waits_for_its_first_health_check(
    child_sets: SetFactory,
) -> None:
    children = await child_sets(probe=False)
    await reload_children(children, [child("x", Endpoint("127.0.0.1", free_port()))])
    new = children.by_name["x"]
    assert not new.healthy
    assert "waiting for its first health check" in new.last_error


# ------------------------------------------------------------------ removed


async def test_removed_idle_child_leaves_and_on_gone_runs_once(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a, b = await child_server(), await child_server()
    children = await child_sets(child("a", a), child("b", b))
    leaving = children.by_name["b"]
    gone = Gone()
    report = await reload_children(children, [child("a", a)], on_gone=gone)
    assert list(report.removed) == ["b"]
    assert leaving.drained and children.leaving("b")
    await until(lambda: "b" not in children.by_name)
    assert gone.names == ["b"]
    assert [c.name for c in children] == ["a"]
    assert not children.leaving("b")


async def test_removed_child_with_calls_in_flight_leaves_only_when_they_end(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a, b = await child_server(), await child_server()
    children = await child_sets(child("a", a), child("b", b))
    busy = children.by_name["b"]
    busy.outstanding_requests = 2
    gone = Gone()
    await reload_children(children, [child("a", a)], on_gone=gone)
    await asyncio.sleep(0.3)
    assert "b" in children.by_name and children.leaving("b") and busy.drained
    assert gone.names == []
    assert not children.set_drained(busy, False)  # cannot be undrained while leaving
    busy.outstanding_requests = 1
    await asyncio.sleep(0.2)
    assert "b" in children.by_name and gone.names == []
    busy.outstanding_requests = 0
    await until(lambda: "b" not in children.by_name)
    assert gone.names == ["b"]


async def test_reload_that_brings_back_a_leaving_child_is_not_applied(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a, b = await child_server(), await child_server()
    children = await child_sets(child("a", a), child("b", b))
    children.by_name["b"].outstanding_requests = 1
    await reload_children(children, [child("a", a)])
    report = await reload_children(children, [child("a", a), child("b", b)])
    assert list(report.added) == []
    [message] = report.not_applied
    assert message.startswith("b: still finishing")
    assert "reload again" in message
    children.by_name["b"].outstanding_requests = 0
    await until(lambda: "b" not in children.by_name)


async def test_on_gone_failure_is_logged_and_the_child_is_forgotten_anyway(
    child_server: ServerFactory, child_sets: SetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await child_server(), await child_server()
    children = await child_sets(child("a", a), child("b", b))
    gone = Gone(fail=True)
    with caplog.at_level(logging.ERROR, logger="common.request.children"):
        await reload_children(children, [child("a", a)], on_gone=gone)
        await until(lambda: "b" not in children.by_name)
    assert gone.names == ["b"]
    assert not children.leaving("b")
    assert any("clean-up on removal failed" in r.getMessage() for r in caplog.records)
    # The tier goes on: a later reload can add it again.
    report = await reload_children(children, [child("a", a), child("b", b)])
    assert list(report.added) == ["b"]


# ------------------------------------------------------------------ changed


async def test_changed_models_are_taken_over(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a = await child_server()
    children = await child_sets(child("a", a))
    report = await reload_children(children, [child("a", a, frozenset({M, "other"}))])
    assert list(report.changed) == [f"a: models ['{M}'] -> ['{M}', 'other']"]
    assert children.by_name["a"].models == {M, "other"}


async def test_changed_location_and_speed_are_taken_over(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a = await child_server()
    children = await child_sets(child("a", a))
    running = children.by_name["a"]
    moved = dataclasses.replace(child("a", a), location=GeoPoint(50.0, 8.0), speed=2.0)
    report = await reload_children(children, [moved])
    assert list(report.changed) == ["a: location, speed 1 -> 2"]
    assert children.by_name["a"] is running  # updated in place, channel kept
    assert running.location == GeoPoint(50.0, 8.0) and running.speed == 2.0


async def test_changed_address_is_not_applied(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a, elsewhere = await child_server(), await child_server()
    children = await child_sets(child("a", a))
    report = await reload_children(children, [child("a", elsewhere, frozenset({M, "other"}))])
    [message] = report.not_applied
    assert f"address {a} -> {elsewhere}" in message
    assert "new name" in message
    assert children.by_name["a"].endpoint == a
    assert list(report.changed) == [f"a: models ['{M}'] -> ['{M}', 'other']"]


async def test_add_remove_and_change_in_one_reload(
    child_server: ServerFactory, child_sets: SetFactory
) -> None:
    a, b, c = await child_server(), await child_server(), await child_server()
    children = await child_sets(child("a", a), child("b", b))
    report = await reload_children(children, [child("a", a, frozenset({"other"})), child("c", c)])
    assert list(report.added) == ["c"]
    assert list(report.removed) == ["b"]
    assert list(report.changed) == [f"a: models ['{M}'] -> ['other']"]
    await until(lambda: "b" not in children.by_name)
    assert sorted(x.name for x in children) == ["a", "c"]
