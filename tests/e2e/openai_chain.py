"""An OpenAI edge on a real chain in this process: global → regional → local → emulated
GPUs, tenants on, a real Redis for quotas and usage. The edge (``openai_listen``) is at
the tier ``edge`` names: the global tier, or an inner tier that clients call directly
(then the chain starts there: a local tier alone in front of its GPUs, or a regional
tier over its local tier), so the same tests hold every tier's OpenAI edge to one
standard."""

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
# The tiers an OpenAI edge is tested at: the edge tier, and inner tiers clients call directly.
EDGES = ("global", "regional", "local")
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
    # The edge tier's V2 gRPC address, beside its OpenAI edge.
    v2_address: str = ""
    # The tier serving the OpenAI edge: global, regional or local.
    edge: str = "global"

    def route(self, gpu: str) -> str:
        """``x-meridian-route`` as this edge answers it for ``gpu`` (from its own tier down)."""
        return f"{ZONE}/{gpu}" if self.edge == "local" else f"{REGION}/{ZONE}/{gpu}"

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
    redis_url: str,
    ids: dict[str, str],
    keys: dict[str, str],
    timeout_s: float | None,
    edge: str = "global",
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
    region = mapping["regions"][0]
    entry = {"global": mapping["global"], "regional": region, "local": region["zones"][0]}[edge]
    entry["openai_listen"] = "127.0.0.1:0"
    if timeout_s is not None:
        entry["openai_timeout_s"] = timeout_s
    return mapping


@asynccontextmanager
async def openai_chain(
    redis_url: str,
    *,
    timeout_s: float | None = None,
    time_scale: float = 0.05,
    edge: str = "global",
) -> AsyncIterator[Chain]:
    """Start the chain up to the ``edge`` tier, wait until the model is ready through it,
    stop it all after."""
    suffix = uuid.uuid4().hex[:8]  # fresh tenants: rate limits live in the shared Redis
    ids = {name: f"{name}-{suffix}" for name in TENANTS}
    keys = {name: f"mk_{name}_{suffix}" for name in TENANTS}
    topo = topology_from_mapping(chain_mapping(redis_url, ids, keys, timeout_s, edge))
    workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=time_scale)
    tiers: list[TierServer] = [build_local_tier(topo, REGION, ZONE)]
    if edge != "local":
        tiers.append(build_regional_tier(topo, REGION))
    if edge == "global":
        tiers.append(build_global_tier(topo))
    top = tiers[-1]
    try:
        async with running_chain(topo, workers, tiers, MODEL, top=top.server.address):
            assert top.openai_edge is not None
            url = f"http://{top.openai_edge.address}/v1"
            yield Chain(url, workers, keys, ids, redis_url, top.server.address, edge)
    finally:
        # The openai client resolves its host on the loop's default executor: join its thread.
        await asyncio.get_running_loop().shutdown_default_executor()
