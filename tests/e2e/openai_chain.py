"""An OpenAI edge on a real chain in this process: global (with ``openai_listen``) →
regional → local → emulated GPUs, tenants on, a real Redis for quotas and usage."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import openai
import redis

from common.basics.redis_embed import free_port
from common.config.topology import topology_from_mapping
from common.request.openai_http import OpenAIEdge
from common.tenancy.auth import hash_key
from common.tenancy.usage import USAGE_STREAM, UsageRecord
from common.tier.server import TierServer
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers
from tests.e2e.chain import running_chain

REGION, ZONE, MODEL = "eu", "eu-1a", "m"
TENANTS: dict[str, dict[str, Any]] = {
    "gold": {"priority_ceiling": "critical"},
    # Two requests a second (burst two), at most sheddable.
    "free": {"priority_ceiling": "sheddable", "requests_per_s": 2},
    "solo": {"max_concurrent": 1},
}


@dataclass
class Chain:
    base_url: str
    workers: ZoneWorkers
    keys: dict[str, str]
    ids: dict[str, str]
    redis_url: str
    # The global tier's V2 gRPC address, beside its OpenAI edge.
    v2_address: str = ""

    def client(self, tenant: str | None = "gold", **headers: str) -> openai.AsyncOpenAI:
        """The stock client with ``tenant``'s key (None: no key) and extra headers."""
        key = self.keys[tenant] if tenant is not None else "none"
        return openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=key,
            max_retries=0,
            timeout=30,
            default_headers=headers or None,
        )

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def running(self) -> int:
        return sum(gpu.engine.running for gpu in self.workers)

    def served(self) -> int:
        return sum(gpu.engine.stats().requests_total for gpu in self.workers)

    def usage(self, tenant: str) -> list[UsageRecord]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            entries: Any = client.xrange(USAGE_STREAM)
        finally:
            client.close()
        records = [UsageRecord.from_fields(fields) for _, fields in entries]
        return [r for r in records if r.tenant == self.ids[tenant]]

    async def wait_usage(
        self, tenant: str, count: int, timeout_s: float = 5.0
    ) -> list[UsageRecord]:
        """``tenant``'s usage records once ``count`` are there (the edge flushes every 0.1 s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            records = self.usage(tenant)
            if len(records) >= count or time.monotonic() > deadline:
                return records
            await asyncio.sleep(0.05)

    async def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Until no GPU runs anything (a cancelled request's slot is back)."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            assert time.monotonic() < deadline, f"GPUs still running {self.running()}"
            await asyncio.sleep(0.02)


def chain_mapping(
    redis_url: str, ids: dict[str, str], keys: dict[str, str], timeout_s: float | None
) -> dict[str, Any]:
    tenants = [
        {"id": ids[name], "api_key_sha256": [hash_key(keys[name])], **limits}
        for name, limits in TENANTS.items()
    ]
    mapping = one_zone_mapping(
        redis_url,
        model=MODEL,
        gpus=1,
        region=REGION,
        zone=ZONE,
        global_listen=f"127.0.0.1:{free_port()}",
        region_listen=f"127.0.0.1:{free_port()}",
        health_interval_s=0.5,
        slow_start_window_s=0,
        auth={"enabled": True, "tenants": tenants},
    )
    mapping["global"]["openai_listen"] = "127.0.0.1:0"
    if timeout_s is not None:
        mapping["global"]["openai_timeout_s"] = timeout_s
    return mapping


@asynccontextmanager
async def openai_chain(
    redis_url: str, *, timeout_s: float | None = None, time_scale: float = 0.05
) -> AsyncIterator[Chain]:
    """Start the chain, wait until the model is ready through it, stop it all after."""
    suffix = uuid.uuid4().hex[:8]  # fresh tenants: rate limits live in the shared Redis
    ids = {name: f"{name}-{suffix}" for name in TENANTS}
    keys = {name: f"mk_{name}_{suffix}" for name in TENANTS}
    topo = topology_from_mapping(chain_mapping(redis_url, ids, keys, timeout_s))
    workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=time_scale)
    edge = build_global_tier(topo)
    tiers: list[TierServer] = [
        build_local_tier(topo, REGION, ZONE),
        build_regional_tier(topo, REGION),
        edge,
    ]
    try:
        async with running_chain(topo, workers, tiers, MODEL):
            (http,) = [s for s in edge.services if isinstance(s, OpenAIEdge)]
            v2 = topo.global_tier.endpoint.address
            yield Chain(f"http://{http.address}/v1", workers, keys, ids, redis_url, v2)
    finally:
        # The openai client resolves its host on the loop's default executor: join its thread.
        await asyncio.get_running_loop().shutdown_default_executor()
