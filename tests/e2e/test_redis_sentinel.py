"""A Redis primary killed under load, behind real Sentinels: nothing is lost.

SLOW-ish (about 15 s): a real Sentinel deployment (``sentinel_group``: a primary,
two replicas, three Sentinels, all the embedded Redis binary on loopback) under
a whole in-process chain (emulated GPUs, local → regional → global) whose
topology names only ``redis+sentinel://…``. Authenticated requests run through
the edge (tenant quotas and concurrency leases in Redis, a usage record each,
``usage_replicas_ack: 1``) while the primary is SIGKILLed. Then:

- no request fails (quotas count in process while no master answers);
- every request has exactly one usage record on the promoted master;
- zone and region summaries appear on the promoted master by themselves, within
  ``RESUME_BOUND_S`` of the promotion (publishers back off to at most 2 s).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
import redis

from common.basics.redis_embed import free_port
from common.capacity.streams import region_stream, zone_stream
from common.config.topology import Topology, topology_from_mapping
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request
from common.tenancy.auth import hash_key
from common.tenancy.usage import USAGE_STREAM, UsageRecord
from global_lb.server import build_global_tier
from local_lb.server import build_local_tier
from regional_lb.server import build_regional_tier
from sim.topology import one_zone_mapping
from sim.worker import ZoneWorkers
from tests.e2e.chain import running_chain
from tests.e2e.sentinel_group import SentinelGroup

MODEL, REGION, ZONE, TENANT, KEY = "m", "r", "r-1a", "acme", "mk_sentinel-test-key"
AUTH = [("authorization", f"Bearer {KEY}")]
# Bounds of the load: it stops at this many calls or after this long, whatever happens.
MAX_CALLS, MAX_LOAD_S, CLIENTS = 3000, 40.0, 6
# Promotion → the first summary on the promoted master: publishers back off 2 s at most.
RESUME_BOUND_S = 3.0


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    group = SentinelGroup()
    try:
        group.start()
        yield group
    finally:
        group.close()


def sentinel_topology(url: str) -> Topology:
    """One zone of two GPUs on the Sentinel URL; a tenant whose quotas never refuse
    here (they are counted, in Redis or in process, not reached); WAIT for a replica."""
    mapping = one_zone_mapping(
        url,
        model=MODEL,
        region=REGION,
        zone=ZONE,
        max_concurrency=8,
        global_listen=f"127.0.0.1:{free_port()}",
        region_listen=f"127.0.0.1:{free_port()}",
        health_interval_s=0.2,
        slow_start_window_s=0,
        summary_cadence_s=0.25,
        usage_replicas_ack=1,
    )
    tenant = {
        "id": TENANT,
        "api_key_sha256": [hash_key(KEY)],
        "requests_per_s": 100000,
        "max_concurrent": 1000,
    }
    mapping["auth"] = {"enabled": True, "tenants": [tenant]}
    return topology_from_mapping(mapping)


@dataclass
class Load:
    """A bounded stream of calls from ``CLIENTS`` concurrent clients until ``stop``."""

    stub: pb_grpc.GRPCInferenceServiceStub
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return sum(self.outcomes.values())

    async def client(self, n: int, deadline: float) -> None:
        i = 0
        while not self.stop.is_set() and self.calls < MAX_CALLS and time.monotonic() < deadline:
            i += 1
            request = generate_request(MODEL, f"client {n} call {i}", max_tokens=4)
            try:
                await self.stub.ModelInfer(request, metadata=AUTH, timeout=10)
                self.outcomes["OK"] += 1
            except grpc.aio.AioRpcError as err:
                self.outcomes[err.code().name] += 1
                self.errors.append(f"{err.code().name}: {err.details()}")

    async def run(self) -> None:
        deadline = time.monotonic() + MAX_LOAD_S
        await asyncio.gather(*(self.client(n, deadline) for n in range(CLIENTS)))

    async def until(self, calls: int, timeout_s: float = 20.0) -> None:
        limit = time.monotonic() + timeout_s
        while self.calls < calls:
            assert time.monotonic() < limit, f"load stalled at {self.calls} calls"
            await asyncio.sleep(0.02)


def first_entry_after(client: redis.Redis, stream: str, after_ms: int) -> int | None:
    """The Redis time (ms) of the first entry of ``stream`` written after ``after_ms``."""
    entries = client.xrange(stream, min=f"{after_ms + 1}-0", count=1)
    return int(entries[0][0].split(b"-")[0]) if entries else None  # type: ignore[index]


async def summaries_resume(client: redis.Redis, after_ms: int) -> dict[str, float]:
    """Seconds after ``after_ms`` at which each stream got its first entry."""
    found: dict[str, float] = {}
    deadline = time.monotonic() + RESUME_BOUND_S + 2
    while len(found) < 2 and time.monotonic() < deadline:
        for name, stream in (
            ("zone", zone_stream(REGION, ZONE)),
            ("region", region_stream(REGION)),
        ):
            at = first_entry_after(client, stream, after_ms)
            if at is not None and name not in found:
                found[name] = (at - after_ms) / 1000
        await asyncio.sleep(0.05)
    return found


async def test_primary_killed_under_load_loses_no_request_and_no_usage_record(
    sentinel_group: SentinelGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    topo = sentinel_topology(sentinel_group.url)
    workers = ZoneWorkers(topo.zone(REGION, ZONE), region=REGION, time_scale=0.05)
    tiers = [
        build_local_tier(topo, REGION, ZONE),
        build_regional_tier(topo, REGION),
        build_global_tier(topo),
    ]
    async with running_chain(topo, workers, tiers, MODEL) as stub:
        load = Load(stub)
        running = asyncio.create_task(load.run())
        try:
            await load.until(100)
            old = sentinel_group.primary()
            killed_at, killed_ms = time.monotonic(), int(time.time() * 1000)
            old.kill()
            new = await sentinel_group.wait_promoted(old)
            promotion_s = time.monotonic() - killed_at
            client = redis.Redis(port=new.port, socket_timeout=2.0)
            try:
                resumed = await summaries_resume(client, killed_ms)
                await load.until(load.calls + 100)  # and the load goes on on the new master
                load.stop.set()
                await running
                records = await usage_records(client, load.calls)
            finally:
                client.close()
        finally:
            load.stop.set()
            await running
        served = sum(w.engine.stats().requests_total for w in workers)
    print(
        f"promotion {promotion_s:.2f} s after the kill; first summaries on the new master "
        f"{resumed} s after the kill; {load.calls} calls {dict(load.outcomes)}"
    )
    assert load.outcomes == Counter(OK=load.calls), load.errors[:5]
    assert served == load.calls
    assert set(resumed) == {"zone", "region"}, f"summaries did not resume: {resumed}"
    assert max(resumed.values()) < promotion_s + RESUME_BOUND_S, resumed
    ids = [r.request_id for r in records]
    assert len(ids) == len(set(ids)) == load.calls  # every request once, none twice
    assert {(r.tenant, r.status) for r in records} == {(TENANT, "OK")}


async def usage_records(client: redis.Redis, expected: int) -> list[UsageRecord]:
    """The usage records on ``client``, once ``expected`` of them arrived (or 15 s passed)."""
    deadline = time.monotonic() + 15
    while True:
        entries = client.xrange(USAGE_STREAM)
        if len(entries) >= expected or time.monotonic() > deadline:  # type: ignore[arg-type]
            return [UsageRecord.from_fields(f) for _, f in entries]  # type: ignore[union-attr]
        await asyncio.sleep(0.1)
