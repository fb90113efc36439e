"""ChildSet: summaries per replica, staleness, hints, change notifications, health."""

import asyncio
import time

import grpc

from common.capacity.summary import decode_hint, encode_hint
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import capacity_pb2
from common.request.children import Child, ChildSet
from common.request.pick import sent_since_report

M = "demo-llm"


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def setup() -> tuple[ChildSet, Child, Clock]:
    clock = Clock()
    zone = Child(name="z", endpoint=Endpoint("127.0.0.1", 1), models=frozenset({M}))
    return ChildSet([zone], probe_interval_s=1, summary_ttl_s=1.5, clock=clock), zone, clock


def summary(source: str, seq: int, healthy: int, busy: int = 0) -> capacity_pb2.CapacitySummary:
    entry = capacity_pb2.ModelCapacity(
        model=M,
        healthy_gpus=healthy,
        total_gpus=4,
        total_slots=16,
        busy_slots=busy,
        free_slots=16 - busy,
    )
    return capacity_pb2.CapacitySummary(source_id=source, sequence=seq, zone="z", models=[entry])


def test_stale_summary_reads_as_unknown_never_as_empty() -> None:
    children, zone, clock = setup()
    children.take_summary("z", summary("a", 1, healthy=4))
    assert zone.model_capacity(M, clock.now, 1.5) is not None
    clock.now += 2.0
    assert zone.model_capacity(M, clock.now, 1.5) is None
    assert zone.may_serve(M, clock.now, 1.5)  # unknown: direct evidence decides


def test_old_sequence_from_the_same_source_is_ignored() -> None:
    children, zone, clock = setup()
    children.take_summary("z", summary("a", 5, healthy=4))
    children.take_summary("z", summary("a", 4, healthy=0))
    entry = zone.model_capacity(M, clock.now, 1.5)
    assert entry is not None and entry.healthy_gpus == 4


def test_two_replicas_combined_and_a_silent_one_dropped() -> None:
    children, zone, clock = setup()
    children.take_summary("z", summary("a", 1, healthy=4, busy=3))
    children.take_summary("z", summary("b", 1, healthy=4, busy=5))
    entry = zone.model_capacity(M, clock.now, 1.5)
    assert entry is not None and (entry.healthy_gpus, entry.busy_slots) == (4, 8)
    clock.now += 1.0
    children.take_summary("z", summary("a", 2, healthy=4, busy=1))
    clock.now += 1.0  # replica b has been silent for 2 s > TTL
    children.take_summary("z", summary("a", 3, healthy=4, busy=1))
    entry = zone.model_capacity(M, clock.now, 1.5)
    assert entry is not None and entry.busy_slots == 1


def test_fresher_hint_wins_over_the_summary() -> None:
    children, zone, clock = setup()
    children.take_summary("z", summary("a", 1, healthy=4))
    clock.now += 0.2
    hint = capacity_pb2.ModelCapacity(model=M, healthy_gpus=0, total_gpus=4)
    children.take_hint(zone, decode_hint(encode_hint(hint), M))
    assert not zone.may_serve(M, clock.now, 1.5)


def test_a_repeated_hint_keeps_counting_what_was_sent_since_its_report() -> None:
    """Every answer repeats the child's newest publication: only a new one restarts the
    count, or a child that looked idle would take every request until it published."""
    children, zone, _ = setup()
    first = decode_hint("h=4,t=4,s=16,f=16,q=0,u=0,w=0.000,c=8000", M)
    children.take_hint(zone, first)
    zone.outstanding_requests = 5  # five sent since that report
    children.take_hint(zone, decode_hint("h=4,t=4,s=16,f=16,q=0,u=0,w=0.000,c=8000", M))
    assert sent_since_report(zone) == 5
    children.take_hint(zone, decode_hint("h=4,t=4,s=16,f=11,q=0,u=0,w=0.300,c=8000", M))
    assert sent_since_report(zone) == 0
    zone.outstanding_requests = 7
    assert sent_since_report(zone) == 2
    zone.outstanding_requests = 3  # back since the report, of those in flight at it
    assert sent_since_report(zone) == -2


def test_significant_change_notifies_listeners() -> None:
    children, _, _ = setup()
    calls: list[int] = []
    children.add_listener(lambda: calls.append(1))
    children.take_summary("z", summary("a", 1, healthy=4))
    children.take_summary("z", summary("a", 2, healthy=4))
    assert len(calls) == 1  # the first summary; the unchanged one is quiet
    children.take_summary("z", summary("a", 3, healthy=2))
    assert len(calls) == 2


def test_changes_held_for_a_block_are_told_once_and_only_if_any() -> None:
    children, zone, _ = setup()
    heard: list[int] = []
    children.add_listener(lambda: heard.append(1))
    with children.changes():
        children.mark_failed(zone, "down")
        children.mark_healthy(zone)
        with children.changes():  # nested: the outer block tells
            children.mark_failed(zone, "down again")
        assert heard == []
    assert heard == [1]
    with children.changes():
        children.mark_failed(zone, "still down")  # no transition
    assert heard == [1]


class NoHealth(pb_grpc.GRPCInferenceServiceServicer):
    """A V2 server with no grpc.health.v1: ServerReady as ``ready`` says."""

    ready = True

    async def ServerReady(self, request: object, context: object) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.ready)


async def test_a_child_without_grpc_health_is_followed_by_server_ready() -> None:
    """Its Watch answers UNIMPLEMENTED: ServerReady every probe interval marks it down
    when it says not ready, and up again (a watch that just ended saw neither)."""
    servicer = NoHealth()
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    child = Child(name="z", endpoint=Endpoint("127.0.0.1", port), models=frozenset({M}))
    children = ChildSet([child], probe_interval_s=0.05, summary_ttl_s=1.5)

    async def until(healthy: bool) -> None:
        deadline = time.monotonic() + 3.0
        while child.healthy is not healthy:
            assert time.monotonic() < deadline, child
            await asyncio.sleep(0.01)

    try:
        await children.start()
        await until(True)
        servicer.ready = False
        await until(False)
        assert child.last_error == "probe: ServerReady says not ready"
        servicer.ready = True
        await until(True)
    finally:
        await children.stop()
        await server.stop(0)
