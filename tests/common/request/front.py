"""A proxy over named child V2 servers, all on loopback: the rig the forwarding-loop,
per-try and quota-failover tests share. Children are ranked by name (``InOrder``),
health probes off; on exit every lease must be back, whatever the test did."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import Forwarder, ForwardingPolicy
from common.request.pick import PickRequest
from common.request.proxy import InferenceProxy, TierSpec
from common.request.server import V2Server


class InOrder:
    """Ranks the children by name: the tests decide who is tried first."""

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        return sorted(children, key=lambda c: c.name)


@dataclass
class Front:
    stub: pb_grpc.GRPCInferenceServiceStub
    children: ChildSet


@asynccontextmanager
async def proxy_over(
    named: Sequence[tuple[str, pb_grpc.GRPCInferenceServiceServicer]],
    *,
    model: str,
    spec: TierSpec,
    policy: ForwardingPolicy,
) -> AsyncIterator[Front]:
    servers = [V2Server(servicer, Endpoint("127.0.0.1", 0)) for _, servicer in named]
    for server in servers:
        await server.start()
    children = ChildSet(
        [
            Child(name, Endpoint("127.0.0.1", server.port), frozenset({model}))
            for (name, _), server in zip(named, servers, strict=True)
        ],
        probe_interval_s=1,
        summary_ttl_s=1,
        probe=False,
    )
    balancer = RankingBalancer(InOrder(), children)
    forwarder = Forwarder(policy, balancer)
    front = V2Server(InferenceProxy(spec, children, balancer, forwarder), Endpoint("127.0.0.1", 0))
    await children.start()
    await front.start()
    channel = grpc.aio.insecure_channel(front.address)
    try:
        yield Front(pb_grpc.GRPCInferenceServiceStub(channel), children)
    finally:
        await channel.close()
        await front.stop(0)
        await children.stop()
        for server in servers:
            await server.stop(0)
    assert [c.outstanding_requests for c in children] == [0] * len(named)  # every lease back
