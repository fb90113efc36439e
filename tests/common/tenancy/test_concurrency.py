"""common.tenancy.concurrency: ``max_concurrent`` across replicas, as leases in a real Redis.

Replicas are ``TenantConcurrency`` objects on one Redis (the session's, or one of
the test's own when it stops, restarts or kills its connections); a crashed holder
is a real process, killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import redis

from common.basics.errors import RETRY_AFTER_MS, TENANT_QUOTA, RouteError
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.request.streaming import Release
from common.tenancy.concurrency import TenantConcurrency
from tests.common.tenancy.test_quota import FakeClock, tenant
from tests.common.tenancy.test_quota_outage import kill_clients

Factory = Callable[..., TenantConcurrency]


def factory(url: str, made: list[TenantConcurrency], prefix: str) -> Factory:
    def make(**options: object) -> TenantConcurrency:
        options.setdefault("redis_timeout_s", 1.0)  # a loaded machine must not time out
        options.setdefault("key_prefix", prefix)
        replica = TenantConcurrency(url, **options)  # type: ignore[arg-type]
        made.append(replica)
        return replica

    return make


@pytest.fixture
async def replicas(redis_server: EmbeddedRedis) -> AsyncIterator[Factory]:
    made: list[TenantConcurrency] = []
    yield factory(redis_server.url, made, f"test:conc:{uuid.uuid4().hex[:8]}")
    for replica in made:
        await replica.close()


@pytest.fixture
async def own_replicas(own_redis: EmbeddedRedis) -> AsyncIterator[Factory]:
    made: list[TenantConcurrency] = []
    yield factory(own_redis.url, made, "meridian:concurrency")
    for replica in made:
        await replica.close()


async def refused(replica: TenantConcurrency, who: object) -> RouteError:
    with pytest.raises(RouteError) as info:
        await replica.acquire(who)  # type: ignore[arg-type]
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return info.value


def held_in_redis(url: str, replica: TenantConcurrency, tenant_id: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.zcard(replica.key(tenant_id)))
    finally:
        client.close()


async def until_granted(replica: TenantConcurrency, who: object, within_s: float) -> Release:
    """Acquire as soon as a slot is free (polled every 20 ms), failing after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await replica.acquire(who)  # type: ignore[arg-type]
        except RouteError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


# ------------------------------------------------------------------ the shared cap


async def test_max_concurrent_holds_across_two_replicas(replicas: Factory) -> None:
    first, second = replicas(replicas=2), replicas(replicas=2)
    who = tenant(max_concurrent=3)
    mine = [await first.acquire(who), await first.acquire(who)]
    await second.acquire(who)
    for replica in (first, second):
        err = await refused(replica, who)
        assert err.message.startswith(
            f"tenant '{who.id}' has 3 requests in flight, its limit (max_concurrent 3)"
        )
        assert dict(err.trailers) == {RETRY_AFTER_MS: "100", TENANT_QUOTA: "max_concurrent"}
    mine.pop()()
    started = time.monotonic()
    await until_granted(second, who, within_s=1.0)  # the other replica sees it at once
    assert time.monotonic() - started < 0.5
    await refused(first, who)
    assert first.outages == second.outages == 0


async def test_a_replica_sees_its_own_release_at_once(replicas: Factory) -> None:
    replica, who = replicas(), tenant(max_concurrent=1)
    for _ in range(20):  # no wait for the keeper between release and acquire
        release = await replica.acquire(who)
        release()


async def test_release_gives_back_exactly_once(
    replicas: Factory, redis_server: EmbeddedRedis
) -> None:
    replica, who = replicas(), tenant(max_concurrent=2)
    first = await replica.acquire(who)
    await replica.acquire(who)
    first()
    first()  # a second call (an error path after a finally) frees nothing more
    await replica.acquire(who)
    await refused(replica, who)
    assert replica.in_flight(who.id) == 2
    await replica.sync(renew=False)
    assert held_in_redis(redis_server.url, replica, who.id) == 2


async def test_uncapped_tenant_takes_no_lease_and_never_touches_redis(
    replicas: Factory,
) -> None:
    replica = TenantConcurrency(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    try:
        who = tenant(requests_per_s=5)
        for _ in range(100):
            (await replica.acquire(who))()
        assert replica.outages == 0 and replica.in_flight(who.id) == 0
    finally:
        await replica.close()


async def test_cancelled_acquire_leaves_no_lease_behind(
    replicas: Factory, redis_server: EmbeddedRedis
) -> None:
    replica, who = replicas(), tenant(max_concurrent=1)
    for turns in range(6):  # cancelled at different points of the round trip
        task = asyncio.create_task(replica.acquire(who))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            (await task)()  # it finished before the cancel landed: give it back
        except asyncio.CancelledError:
            pass
    for _ in range(50):
        await asyncio.sleep(0.02)
        if held_in_redis(redis_server.url, replica, who.id) == 0:
            break
    assert held_in_redis(redis_server.url, replica, who.id) == 0
    (await replica.acquire(who))()  # the slot is free


# ------------------------------------------------------------------ crashed holder

HOLDER = """
import asyncio, sys
from common.config.access import TenantConfig
from common.tenancy.concurrency import TenantConcurrency

async def main():
    replica = TenantConcurrency(sys.argv[1], key_prefix=sys.argv[2], lease_ttl_s=1.0,
                                redis_timeout_s=1.0)
    who = TenantConfig(id=sys.argv[3], key_hashes=frozenset(), max_concurrent=2)
    await replica.acquire(who)
    await replica.acquire(who)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_leases_of_a_crashed_holder_free_after_their_expiry(
    replicas: Factory, redis_server: EmbeddedRedis
) -> None:
    survivor, who = replicas(lease_ttl_s=1.0), tenant(max_concurrent=2)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, redis_server.url, survivor.key_prefix, who.id
    )
    try:
        for _ in range(400):  # its interpreter starting, bounded at 20 s
            if held_in_redis(redis_server.url, survivor, who.id) == 2:
                break
            assert holder.returncode is None, "the holder died on its own"
            await asyncio.sleep(0.05)
        assert held_in_redis(redis_server.url, survivor, who.id) == 2
        await asyncio.sleep(1.2)  # past the TTL: a live holder renews its leases
        await refused(survivor, who)
        holder.send_signal(signal.SIGKILL)
        await asyncio.wait_for(holder.wait(), 5)
        killed = time.monotonic()
        await until_granted(survivor, who, within_s=3.0)
        assert time.monotonic() - killed <= 1.5  # the TTL (1 s) after the last renewal
    finally:
        if holder.returncode is None:
            holder.kill()
            await asyncio.wait_for(holder.wait(), 5)


# ------------------------------------------------------------------ Redis failures


async def test_killed_connections_do_not_flip_the_cap(
    own_replicas: Factory, own_redis: EmbeddedRedis
) -> None:
    replica, who = own_replicas(), tenant(max_concurrent=20)
    held = await asyncio.gather(*(replica.acquire(who) for _ in range(8)))
    assert kill_clients(own_redis) >= 1
    held += await asyncio.gather(*(replica.acquire(who) for _ in range(8)))
    assert replica.outages == 0 and not replica.degraded
    for release in held:
        release()
    await replica.sync(renew=True)
    assert held_in_redis(own_redis.url, replica, who.id) == 0


async def test_redis_down_caps_each_replica_at_its_share_then_shares_again(
    own_replicas: Factory, own_redis: EmbeddedRedis
) -> None:
    clock = FakeClock()
    first = own_replicas(replicas=2, clock=clock)
    second = own_replicas(replicas=2, clock=clock)
    who = tenant(max_concurrent=3)  # each replica's share while Redis is down: 2
    ones = [await first.acquire(who)]  # through Redis
    own_redis.stop()
    ones.append(await first.acquire(who))  # Redis down: in process, its lease counts
    await refused(first, who)
    assert first.degraded and first.outages == 1
    twos = [await second.acquire(who), await second.acquire(who)]
    await refused(second, who)

    own_redis.start()  # empty: every lease is gone from it
    clock.advance(1.0)  # past the back-off
    await second.sync(renew=True)  # its renewal (the keeper's, within 1 s) puts its two back
    await refused(first, who)  # first puts its own two back, then counts: 4
    assert held_in_redis(own_redis.url, first, who.id) == 4  # the fallback's overshoot
    assert not first.degraded and not second.degraded
    ones.pop()()
    twos.pop()()
    await first.sync(renew=False)
    await second.sync(renew=False)
    await second.acquire(who)  # 2 held: one slot
    await refused(first, who)
    await refused(second, who)


async def test_redis_restarted_empty_between_calls_gets_this_replicas_leases_back(
    own_replicas: Factory, own_redis: EmbeddedRedis
) -> None:
    replica, who = own_replicas(), tenant(max_concurrent=2)
    await replica.acquire(who)
    await replica.acquire(who)
    own_redis.stop()
    own_redis.start()
    await refused(replica, who)  # its broken connection: leases back, then the count
    assert replica.outages == 0
    assert held_in_redis(own_redis.url, replica, who.id) == 2
