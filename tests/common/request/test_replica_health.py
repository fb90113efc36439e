"""Health of a child dialled by name over several replicas (``common.request.replicas``):
a DNS server on loopback answers the name with two replicas, real grpc.aio servers with
the real grpc.health.v1 servicer serve on both.

The tier's Watch follows one replica; a NOT_SERVING or a break there is confirmed over
the channel, so the child is reported down only when no replica serves, and a failed
forward is probed again at once instead of after the probe interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.basics.redis_embed import free_port
from common.basics.tasks import cancel_and_wait
from common.config.access import Limits
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.children import Child, ChildSet
from common.request.health import HealthChecker
from common.request.replicas import REPLICA_HEALTH, replica_channel_options, replica_target
from common.request.server import V2_SERVICE, dial, server_options
from sim.dns_server import LoopbackDns, loopback_dns

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NAME, A, B = "zone.replicas.test", "127.0.0.2", "127.0.0.3"


class Ready(pb_grpc.GRPCInferenceServiceServicer):
    async def ServerReady(self, request: object, context: object) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)


@dataclass
class Replica:
    server: grpc.aio.Server
    health: health.aio.HealthServicer


@dataclass
class Replicas:
    dns: LoopbackDns
    address: Endpoint
    by_ip: dict[str, Replica]

    async def set(self, ip: str, status: int) -> None:
        await self.by_ip[ip].health.set(V2_SERVICE, status)


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    port = free_port(A)
    with loopback_dns({NAME: [A, B]}) as dns:
        made: dict[str, Replica] = {}
        try:
            for ip in (A, B):
                # As a tier's: it accepts its callers' keepalive pings (else GOAWAY after 3).
                server = grpc.aio.server(options=server_options(Limits()))
                servicer = health.aio.HealthServicer()
                health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
                pb_grpc.add_GRPCInferenceServiceServicer_to_server(Ready(), server)
                assert server.add_insecure_port(f"{ip}:{port}") == port
                await server.start()
                made[ip] = Replica(server, servicer)
                await servicer.set(REPLICA_HEALTH, SERVING)
                await servicer.set(V2_SERVICE, SERVING)
            yield Replicas(dns, Endpoint(NAME, port), made)
        finally:
            for replica in made.values():
                await replica.server.stop(0)


class Reports:
    def __init__(self) -> None:
        self.seen: list[tuple[bool, str]] = []

    def __call__(self, healthy: bool, reason: str) -> None:
        self.seen.append((healthy, reason))

    async def until(self, predicate: Callable[[tuple[bool, str]], bool]) -> None:
        deadline = time.monotonic() + 5.0
        while not (self.seen and predicate(self.seen[-1])):
            if time.monotonic() > deadline:
                raise AssertionError(f"no such report; saw {self.seen}")
            await asyncio.sleep(0.01)


async def test_a_name_is_down_only_when_no_replica_serves(replicas: Replicas) -> None:
    channel = dial(
        replica_target(replicas.address, replicas.dns.authority), None, [*replica_channel_options()]
    )
    reports = Reports()
    task = asyncio.create_task(HealthChecker(channel).watch(reports))
    try:
        await reports.until(lambda r: r[0])
        # Each replica in turn stops serving (so the watch is on one that does, whichever
        # it was on): the other one overrules it.
        await replicas.set(A, NOT_SERVING)
        await asyncio.sleep(0.5)
        await replicas.set(A, SERVING)
        await replicas.set(B, NOT_SERVING)
        await asyncio.sleep(0.5)
        assert all(healthy for healthy, _ in reports.seen), reports.seen
        await replicas.set(A, NOT_SERVING)  # now none serves
        await reports.until(lambda r: r == (False, "health: not serving"))
        # (Back up with one replica only, the watch may be on the other: the tier's probe
        # loop finds the serving one, test_a_failed_forward... below.)
        await replicas.set(A, SERVING)
        await replicas.set(B, SERVING)
        await reports.until(lambda r: r[0])
        # A replica's process dies (its stream breaks, if the watch was on it): the
        # other one serves, so no down report follows.
        since = len(reports.seen)
        await replicas.by_ip[A].server.stop(0)
        await asyncio.sleep(1.0)
        assert all(healthy for healthy, _ in reports.seen[since:]), reports.seen[since:]
        assert not task.done()
    finally:
        await cancel_and_wait([task])
        await channel.close()


async def test_a_failed_forward_to_a_name_is_probed_at_once(replicas: Replicas) -> None:
    zone = Child(name="z", endpoint=replicas.address, models=frozenset({"m"}))
    # A probe interval far longer than the test: only the immediate probe can bring it back.
    children = ChildSet([zone], probe_interval_s=30, summary_ttl_s=1.5, dns=replicas.dns.authority)
    await children.start()
    try:
        assert zone.healthy
        await asyncio.sleep(0.5)  # its watch has had its first SERVING: it reports no more
        children.mark_failed(zone, "UNAVAILABLE: the call met a replica that died")
        assert not zone.healthy
        for _ in range(300):  # 3 s at most
            if zone.healthy:
                break
            await asyncio.sleep(0.01)
        assert zone.healthy, zone.last_error
        # A child dialled as it is (a GPU: no dns) waits for the probe loop as before.
        gpu = Child(name="g", endpoint=replicas.address, models=frozenset({"m"}))
        plain = ChildSet([gpu], probe_interval_s=30, summary_ttl_s=1.5, probe=True)
        gpu.stub = None
        plain.mark_failed(gpu, "UNAVAILABLE")
        await asyncio.sleep(0.3)
        assert not gpu.healthy
    finally:
        await children.stop()
