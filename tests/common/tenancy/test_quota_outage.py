"""The rate limiter through Redis restarts, killed connections and pauses: no fresh bursts.

Each test runs its own embedded Redis (it stops, restarts or pauses it) and a
limiter on it; the bound checked is the class docstring's: across an outage the
tenant gets at most one burst more than ``burst + rate × t``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis

from common.basics.redis_embed import EmbeddedRedis
from common.tenancy.quota import TenantRateLimiter
from tests.common.tenancy.test_quota import FakeClock, admitted, refusal, tenant

Factory = Callable[..., TenantRateLimiter]


@pytest.fixture
async def limiters(own_redis: EmbeddedRedis) -> AsyncIterator[Factory]:
    made: list[TenantRateLimiter] = []

    def make(**options: object) -> TenantRateLimiter:
        options.setdefault("redis_timeout_s", 1.0)  # a loaded machine must not time out
        limiter = TenantRateLimiter(own_redis.url, **options)  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.close()


def kill_clients(server: EmbeddedRedis) -> int:
    """CLIENT KILL every connection but this one: each pooled connection is now broken."""
    client = redis.Redis.from_url(server.url)
    try:
        return int(client.client_kill_filter(_type="normal", skipme=True))
    finally:
        client.close()


async def pool_of(limiter: TenantRateLimiter, n: int) -> None:
    """Open ``n`` pooled connections on the limiter's client: ``n`` PINGs at once
    (admissions made at once share one connection, common.tenancy.script_batch)."""
    assert all(await asyncio.gather(*(limiter.shared.client.ping() for _ in range(n))))


async def test_killed_pooled_connections_do_not_flip_the_limiter(
    limiters: Factory, own_redis: EmbeddedRedis
) -> None:
    limiter, who = limiters(), tenant(requests_per_s=10_000)
    await pool_of(limiter, 8)
    assert kill_clients(own_redis) >= 8
    results = await asyncio.gather(*(admitted(limiter, who, 1) for _ in range(8)))
    assert all(results)
    assert limiter.outages == 0 and not limiter.degraded  # each broken one was retried anew
    assert kill_clients(own_redis) >= 1
    for _ in range(5):  # one after another: the LIFO pool hands out broken ones too
        assert await admitted(limiter, who, 1)
    assert limiter.outages == 0


async def test_fallback_starts_where_the_shared_bucket_was_not_from_a_full_burst(
    limiters: Factory, own_redis: EmbeddedRedis
) -> None:
    clock = FakeClock()
    limiter, who = limiters(clock=clock), tenant(requests_per_s=10)  # burst 10
    for _ in range(10):
        assert await admitted(limiter, who, 1)
    own_redis.stop()
    await refusal(limiter, who, 1)  # in process now, and the bucket is still empty
    assert limiter.degraded and limiter.outages == 1
    clock.advance(0.1)  # one interval refills one request
    assert await admitted(limiter, who, 1)
    await refusal(limiter, who, 1)


async def test_redis_restarted_empty_hands_out_no_fresh_burst(
    limiters: Factory, own_redis: EmbeddedRedis
) -> None:
    clock = FakeClock()
    limiter, who = limiters(clock=clock), tenant(requests_per_s=10)
    for _ in range(10):
        assert await admitted(limiter, who, 1)
    own_redis.stop()
    own_redis.start()  # empty: the tenant's TAT is gone
    err = await refusal(limiter, who, 1)  # the copy's floor, not a fresh bucket
    assert 0 < int(dict(err.trailers)["retry-after-ms"]) <= 100
    assert limiter.outages == 0  # the broken connection was retried on a new one
    client = redis.Redis.from_url(own_redis.url)
    try:
        clock.advance(0.1)
        await asyncio.sleep(0.1)  # Redis's clock moves too
        assert await admitted(limiter, who, 1)
        # The TAT Redis now holds is the copy's, a full bucket ahead, not one request's.
        assert 800 <= client.pttl(f"{limiter.key_prefix}:{{{who.id}}}:rps") <= 1000
    finally:
        client.close()


async def test_what_was_admitted_in_process_reaches_redis_when_it_answers_again(
    limiters: Factory, own_redis: EmbeddedRedis
) -> None:
    """Redis paused (state kept, answers late): the stored TAT misses the in-process
    admissions; the first call back forces this replica's copy over it."""
    clock = FakeClock()
    limiter = limiters(clock=clock, redis_timeout_s=0.05)
    who = tenant(tokens_per_min=600)  # 10 tokens/s, burst 100 (10 s)
    assert await admitted(limiter, who, 10)  # Redis: 1 s of the bucket taken
    client = redis.Redis.from_url(own_redis.url)
    try:
        client.client_pause(300)
        for _ in range(9):  # the first times out: in process from then on
            assert await admitted(limiter, who, 10)
        assert limiter.degraded
        await refusal(limiter, who, 10)  # the copy is empty now
        await asyncio.sleep(0.4)  # the pause is over; Redis still holds ~0.6 s of TAT
        clock.advance(0.6)  # past the back-off; 6 tokens refilled in the copy
        assert await admitted(limiter, who, 1)  # the probe, with the forced floor
        assert not limiter.degraded
        await refusal(limiter, who, 10)  # Redis alone would have had ~94 tokens
        assert client.pttl(f"{limiter.key_prefix}:{{{who.id}}}:tpm") > 9000
    finally:
        client.close()


async def hammer(limiter: TenantRateLimiter, who: object, end: float) -> int:
    count = 0
    for _ in range(20_000):  # bounded, however fast Redis answers
        if time.monotonic() >= end:
            break
        if await admitted(limiter, who, 1):  # type: ignore[arg-type]
            count += 1
        else:
            await asyncio.sleep(0.002)  # a client at its limit, retrying soon
    return count


async def test_redis_restart_mid_run_admits_at_most_one_burst_over_the_limit(
    limiters: Factory, own_redis: EmbeddedRedis
) -> None:
    """A tenant at its limit from four concurrent callers (four pooled connections);
    Redis restarts empty in the middle: over the run, admitted ≤ rate × t + 2 bursts."""
    rate = burst = 20
    limiter, who = limiters(redis_timeout_s=0.2), tenant(requests_per_s=rate)
    start = time.monotonic()
    end = start + 2.5

    async def restart() -> None:
        await asyncio.sleep(0.8)
        own_redis.stop()  # blocks the loop a moment: an outage for every caller
        await asyncio.sleep(0.3)
        own_redis.start()

    counts, _ = await asyncio.gather(
        asyncio.gather(*(hammer(limiter, who, end) for _ in range(4))), restart()
    )
    elapsed = time.monotonic() - start
    total = sum(counts)
    assert total <= rate * elapsed + 2 * burst, (total, elapsed, limiter.outages)
    assert total >= rate * 2.0  # and the tenant did get its rate meanwhile
