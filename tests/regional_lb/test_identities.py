"""Identities per tier, end to end in one process: a regional tier, its local tier and a
GPU that serves TLS, all on real gRPC with certificates from ``generate_pki``.

Defect: every tier used to hold the same certificate, so whoever had one inner
tier's key could claim any tenant at any tier. Now each instance has its own
identity and believes internal metadata only from its parent: a forged
``x-meridian-tenant`` from another tier's certificate is refused with
PERMISSION_DENIED (nothing reaches a GPU), while the parent's tenant still
passes through to the local tier, over TLS to the GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.identity import GLOBAL, Identity, gpu_servers, local, regional
from common.config.node import ConfigError
from common.config.pki import FleetCA, generate_pki
from common.config.tls import TierTls, fleet_identities, gpu_server_credentials
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import admin_pb2 as apb
from common.gen.meridian.v1 import admin_pb2_grpc as apb_grpc
from common.observability.metrics import counter_values
from common.observability.tier_metrics import REQUEST_LABELS
from common.request.routing import ROUTE, TENANT
from common.request.v2 import generate_request
from common.tenancy.auth import hash_key
from common.tier.server import TierServer
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers

REGION, ZONE, MODEL = "r", "r-1a", "m"
THE_LOCAL, OTHER_REGION = local(REGION, ZONE), regional("elsewhere")


@dataclass
class Region:
    topology: Topology
    regional: TierServer
    local: TierServer
    workers: ZoneWorkers

    def tls_as(self, identity: Identity) -> TierTls:
        assert self.topology.tls is not None
        return TierTls.load(self.topology.tls, identity)

    def channel(self, tier: TierServer, identity: Identity) -> grpc.aio.Channel:
        creds = self.tls_as(identity).channel_credentials()
        return grpc.aio.secure_channel(tier.server.address, creds)

    def served_by_gpus(self) -> int:
        return sum(w.engine.stats().requests_total for w in self.workers)


def fleet(tmp: Path, redis_url: str) -> Topology:
    """One region, one zone, one GPU that serves TLS on the fleet's CA; tenant acme."""
    ca = FleetCA.create(tmp / "pki")
    raw = one_zone_mapping(
        redis_url,
        gpus=1,
        model=MODEL,
        region=REGION,
        zone=ZONE,
        region_listen=f"127.0.0.1:{free_port()}",
        health_interval_s=2.0,  # a starved CPU may take longer than 0.5 s for a handshake
        auth={"enabled": True, "tenants": [{"id": "acme", "api_key_sha256": [hash_key("k")]}]},
        tls={"ca": ca.tls.ca, "certs": ca.tls.certs},
    )
    raw["regions"][0]["zones"][0]["gpus"][0]["tls"] = True
    topology = topology_from_mapping(raw)
    # And identities of a sibling region, which a forger might hold.
    ca.issue([*fleet_identities(topology), OTHER_REGION, local("elsewhere", "e-1a")])
    return topology


@pytest.fixture
async def region(tmp_path: Path, redis_server: EmbeddedRedis) -> AsyncIterator[Region]:
    topology = fleet(tmp_path, redis_server.url)
    zone = topology.zone(REGION, ZONE)
    # As `meridian worker` does: the zone's GPU certificate under tls.certs.
    tls = gpu_server_credentials(topology, REGION, zone)
    workers = ZoneWorkers(zone, region=REGION, time_scale=0.05, tls=tls)
    await workers.start()
    local_tier = build_local_tier(topology, REGION, ZONE)
    regional_tier = build_regional_tier(topology, REGION)
    try:
        await local_tier.start()
        await regional_tier.start()
        await serving(local_tier, regional_tier)
        yield Region(topology, regional_tier, local_tier, workers)
    finally:
        await regional_tier.stop(0)
        await local_tier.stop(0)
        await workers.stop(0)


async def serving(*tiers: TierServer) -> None:
    """Until every child of ``tiers`` is healthy (the first TLS handshakes of a starved
    CPU may miss a health check)."""
    for _ in range(1000):
        if all(c.healthy for t in tiers for c in t.children):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the tiers' children did not come up")


def counted(tier: TierServer) -> dict[tuple[str, ...], float]:
    return counter_values(tier.metrics.requests, REQUEST_LABELS)


async def counted_soon(tier: TierServer, expected: dict[tuple[str, ...], float]) -> None:
    """A call is counted once its handler has ended, which may be just after the caller
    saw the answer."""
    for _ in range(200):
        if counted(tier) == expected:
            return
        await asyncio.sleep(0.01)
    assert counted(tier) == expected


async def infer(channel: grpc.aio.Channel) -> str:
    """One generate request claiming tenant acme; the route trailer."""
    call = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
        generate_request(MODEL, "whose tenant am I", 2), metadata=[(TENANT, "acme")], timeout=10
    )
    await call
    return dict(await call.trailing_metadata())[ROUTE]


async def refused(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await infer(channel)
    return err.value


@pytest.mark.parametrize("forger", [THE_LOCAL, OTHER_REGION], ids=str)
async def test_a_forged_tenant_from_another_tiers_certificate_is_refused(
    region: Region, forger: Identity
) -> None:
    async with region.channel(region.regional, forger) as channel:
        error = await refused(channel)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    details = error.details() or ""
    assert "serves only its parent, the global tier (spiffe://meridian/global)" in details
    assert details.endswith(f"the caller is {forger.uri}")
    # Nothing went further: no GPU generated, the local tier saw no call.
    assert region.served_by_gpus() == 0
    assert counted(region.local) == {}
    # Counted, without a model or tenant: it was refused before anything was read.
    await counted_soon(region.regional, {("regional", "-", "PERMISSION_DENIED", "-"): 1.0})


async def test_the_parents_tenant_passes_through_to_the_local_tier_and_the_gpu(
    region: Region,
) -> None:
    async with region.channel(region.regional, GLOBAL) as channel:
        route = await infer(channel)
    assert route == f"{REGION}/{ZONE}/g0"  # served by the GPU, over TLS
    assert region.served_by_gpus() == 1
    await counted_soon(region.regional, {("regional", MODEL, "OK", "acme"): 1.0})
    await counted_soon(region.local, {("local", MODEL, "OK", "acme"): 1.0})


async def test_the_local_tier_serves_its_own_regional_tier_only(region: Region) -> None:
    for caller in (GLOBAL, OTHER_REGION):  # the grandparent is not the parent either
        async with region.channel(region.local, caller) as channel:
            error = await refused(channel)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "the local tier of r/r-1a serves only its parent, the regional tier of r" in (
            error.details() or ""
        )
    async with region.channel(region.local, regional(REGION)) as channel:
        assert await infer(channel) == f"{ZONE}/g0"


async def test_the_admin_api_of_an_inner_tier_is_its_parents_too(region: Region) -> None:
    async with region.channel(region.regional, THE_LOCAL) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await apb_grpc.AdminStub(channel).ListTopology(apb.ListTopologyRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_gpu_with_tls_serves_tls_only(region: Region) -> None:
    gpu = region.topology.zone(REGION, ZONE).gpus[0]
    async with grpc.aio.insecure_channel(gpu.endpoint.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(
                pb.ServerReadyRequest(), timeout=5
            )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Any caller that verifies it against the fleet's CA is served: no client certificate.
    ca_only = grpc.ssl_channel_credentials(region.tls_as(GLOBAL).ca)
    async with grpc.aio.secure_channel(gpu.endpoint.address, ca_only) as channel:
        reply = await pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(
            pb.ServerReadyRequest(), timeout=5
        )
    assert reply.ready


async def test_a_gpu_with_its_own_ca_is_verified_against_it(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """``tls: {ca: PATH}``: the GPU's certificate comes from elsewhere (here another CA,
    handed to the worker as ``--tls-cert``/``--tls-key`` would), and the local tier
    verifies it against that CA, not the fleet's."""
    own = generate_pki(tmp_path / "gpu-pki", [gpu_servers(REGION, ZONE)])
    raw = one_zone_mapping(
        redis_server.url, gpus=1, model=MODEL, region=REGION, zone=ZONE, health_interval_s=2.0
    )
    raw["regions"][0]["zones"][0]["gpus"][0]["tls"] = {"ca": own.ca}
    ca = FleetCA.create(tmp_path / "pki")
    raw["tls"] = {"ca": ca.tls.ca, "certs": ca.tls.certs}
    topology = topology_from_mapping(raw)
    ca.issue(fleet_identities(topology))
    zone = topology.zone(REGION, ZONE)
    with pytest.raises(ConfigError, match=r"^--tls-cert: GPU g0 serves TLS with a CA"):
        gpu_server_credentials(topology, REGION, zone)  # the fleet holds no such certificate
    files = own.cert_file(gpu_servers(REGION, ZONE)), own.key_file(gpu_servers(REGION, ZONE))
    tls = gpu_server_credentials(
        topology, REGION, zone, cert_file=str(files[0]), key_file=str(files[1])
    )
    workers = ZoneWorkers(zone, region=REGION, time_scale=0.05, tls=tls)
    await workers.start()
    tier = build_local_tier(topology, REGION, ZONE)
    try:
        await tier.start()
        await serving(tier)
        creds = TierTls.load(ca.tls, regional(REGION)).channel_credentials()
        async with grpc.aio.secure_channel(zone.endpoint.address, creds) as channel:
            assert await infer(channel) == f"{ZONE}/g0"
    finally:
        await tier.stop(0)
        await workers.stop(0)
