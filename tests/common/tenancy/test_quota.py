import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import redis

from common.basics.errors import RETRY_AFTER_MS, TENANT_QUOTA, RouteError
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.access import TenantConfig
from common.tenancy.quota import (
    TenantRateLimiter,
    gcra,
    request_burst,
    token_burst,
)
from common.tenancy.quota_scripts import GCRA

LimiterFactory = Callable[..., TenantRateLimiter]
QUOTA_LOG = "common.tenancy.shared_redis"


def tenant(
    requests_per_s: float | None = None,
    tokens_per_min: float | None = None,
    max_concurrent: int | None = None,
) -> TenantConfig:
    return TenantConfig(
        id=f"t-{uuid.uuid4().hex[:8]}",
        key_hashes=frozenset(),
        requests_per_s=requests_per_s,
        tokens_per_min=tokens_per_min,
        max_concurrent=max_concurrent,
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def retry_after_ms(err: RouteError) -> int:
    return int(dict(err.trailers)[RETRY_AFTER_MS])


async def refusal(limiter: TenantRateLimiter, who: TenantConfig, tokens: int) -> RouteError:
    with pytest.raises(RouteError) as info:
        await limiter.admit(who, tokens)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return info.value


async def admitted(limiter: TenantRateLimiter, who: TenantConfig, tokens: int) -> bool:
    try:
        await limiter.admit(who, tokens)
    except RouteError as err:
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False
    return True


@pytest.fixture
async def limiters(redis_server: EmbeddedRedis) -> AsyncIterator[LimiterFactory]:
    """Limiters on the session Redis under a key prefix of their own; closed at teardown.

    Their Redis timeout is 1 s, not 50 ms, so a loaded test machine cannot push them
    into the in-process fallback; the tests of the fallback set their own.
    """
    made: list[TenantRateLimiter] = []
    prefix = f"test:quota:{uuid.uuid4().hex[:8]}"

    def make(
        url: str = redis_server.url, *, replicas: int = 1, redis_timeout_s: float = 1.0
    ) -> TenantRateLimiter:
        limiter = TenantRateLimiter(
            url, replicas=replicas, key_prefix=prefix, redis_timeout_s=redis_timeout_s
        )
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.close()


# --------------------------------------------------------------------------- GCRA, pure


def test_gcra_first_request_conforms() -> None:
    assert gcra(tat=0.0, now=10.0, interval=0.1, burst=5, cost=1) == (pytest.approx(10.1), 0.0)


def test_gcra_burst_conforms_then_next_waits_one_interval() -> None:
    tat = 10.0
    for _ in range(5):
        tat, wait = gcra(tat, 10.0, interval=0.1, burst=5, cost=1)
        assert wait == 0.0
    _, wait = gcra(tat, 10.0, interval=0.1, burst=5, cost=1)
    assert wait == pytest.approx(0.1)


def test_gcra_cost_above_burst_never_conforms() -> None:
    _, wait = gcra(tat=0.0, now=10.0, interval=0.1, burst=5, cost=6)
    assert wait == pytest.approx(0.1)  # waits even on an empty bucket: never fits


def test_bursts_are_one_second_of_requests_and_ten_seconds_of_tokens() -> None:
    assert request_burst(50) == 50
    assert request_burst(0.2) == 1
    assert token_burst(6000) == pytest.approx(1000)
    assert token_burst(3) == 1


# --------------------------------------------------------------------------- shared limits


async def test_requests_per_s_admits_a_burst_then_exhausted_retry_after_near_one_over_rate(
    limiters: LimiterFactory,
) -> None:
    limiter, who = limiters(), tenant(requests_per_s=5)
    for _ in range(5):
        await limiter.admit(who, 10)
    err = await refusal(limiter, who, 10)
    wait_ms = retry_after_ms(err)
    assert 120 <= wait_ms <= 200  # 1/rate = 200 ms, less the few ms the burst took
    await asyncio.sleep(wait_ms / 1000)
    await limiter.admit(who, 10)  # the retry-after is honest


async def test_tokens_per_min_admits_its_burst_then_exhausted(limiters: LimiterFactory) -> None:
    limiter, who = limiters(), tenant(tokens_per_min=6000)  # 100 tokens/s, burst 1000
    for _ in range(4):
        await limiter.admit(who, 250)
    err = await refusal(limiter, who, 250)
    assert "tokens_per_min" in err.message
    assert 2300 <= retry_after_ms(err) <= 2500  # 250 tokens at 100/s


async def test_failed_request_rate_check_consumes_no_token_quota(
    limiters: LimiterFactory,
) -> None:
    limiter = limiters()
    who = tenant(requests_per_s=1, tokens_per_min=600)  # 10 tokens/s, burst 100
    await limiter.admit(who, 60)
    for _ in range(10):
        err = await refusal(limiter, who, 40)  # 40 tokens are there; the request slot is not
        assert "requests_per_s" in err.message and "tokens_per_min" not in err.message
    await asyncio.sleep(retry_after_ms(err) / 1000)
    await limiter.admit(who, 45)  # 40 left + ~10 refilled: none went to refused requests


async def test_failed_token_check_consumes_no_request_quota(limiters: LimiterFactory) -> None:
    limiter = limiters()
    who = tenant(requests_per_s=3, tokens_per_min=600)  # burst 3 requests, 100 tokens
    await limiter.admit(who, 100)
    for _ in range(5):
        err = await refusal(limiter, who, 50)
        assert "tokens_per_min" in err.message and "requests_per_s" not in err.message
    await asyncio.sleep(0.25)
    await limiter.admit(who, 1)  # 2 request slots left: none went to refused requests
    await limiter.admit(who, 1)


@pytest.mark.parametrize(
    ("limits", "tokens", "rate", "burst"),
    [
        ({"requests_per_s": 100, "tokens_per_min": 6_000_000}, 10, 100, 100),
        ({"requests_per_s": 10_000, "tokens_per_min": 60_000}, 10, 100, 1000),
    ],
    ids=["requests_per_s", "tokens_per_min"],
)
async def test_two_replicas_together_admit_at_most_limit_times_time_plus_one_burst(
    limiters: LimiterFactory, limits: dict[str, float], tokens: int, rate: float, burst: float
) -> None:
    """``rate`` and ``burst`` in requests of ``tokens``, whichever limit binds."""
    replicas = [limiters(replicas=2), limiters(replicas=2)]
    who = tenant(limits["requests_per_s"], limits["tokens_per_min"])
    duration_s = 2.0

    async def hammer(limiter: TenantRateLimiter, end: float) -> int:
        count = 0
        for _ in range(100_000):  # bounded, however fast Redis answers
            if time.monotonic() >= end:
                break
            count += await admitted(limiter, who, tokens)
        return count

    start = time.monotonic()
    counts = await asyncio.gather(
        *(hammer(limiter, start + duration_s) for limiter in replicas for _ in range(3))
    )
    elapsed = time.monotonic() - start
    total = sum(counts)
    assert [limiter.outages for limiter in replicas] == [0, 0]  # all of it went through Redis
    assert total <= rate * elapsed + burst
    assert total >= 0.9 * (rate * duration_s + burst)  # and the limit is actually reached
    assert sum(counts[:3]) > 0 and sum(counts[3:]) > 0


async def test_unlimited_tenant_admitted_without_touching_redis(
    limiters: LimiterFactory,
) -> None:
    limiter = limiters(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    who = tenant(max_concurrent=2)
    for _ in range(1000):
        await limiter.admit(who, 100_000)
    assert not limiter.degraded and limiter.outages == 0


async def test_exhausted_error_names_the_limit_and_carries_retry_after(
    limiters: LimiterFactory,
) -> None:
    limiter, who = limiters(), tenant(requests_per_s=2)
    await limiter.admit(who, 1)
    await limiter.admit(who, 1)
    err = await refusal(limiter, who, 1)
    wait_ms = retry_after_ms(err)
    assert err.trailers == ((RETRY_AFTER_MS, str(wait_ms)), (TENANT_QUOTA, "requests_per_s"))
    assert err.message.startswith(f"tenant '{who.id}' is over its requests_per_s limit (2)")
    assert f"retry after {wait_ms} ms" in err.message


async def test_over_both_limits_names_both_and_retry_after_is_the_longer(
    limiters: LimiterFactory,
) -> None:
    limiter, who = limiters(), tenant(requests_per_s=1, tokens_per_min=600)
    await limiter.admit(who, 100)
    err = await refusal(limiter, who, 50)
    assert "requests_per_s limit (1) and its tokens_per_min limit (600)" in err.message
    assert 4800 <= retry_after_ms(err) <= 5000  # 50 tokens at 10/s, not the 1 s of requests


async def test_request_larger_than_token_burst_is_invalid_argument(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    limiter, who = limiters(), tenant(tokens_per_min=600)  # burst 100 tokens
    with pytest.raises(RouteError) as info:
        await limiter.admit(who, 101)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "101 tokens" in info.value.message and "tokens_per_min limit (600)" in info.value.message
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.keys(f"{limiter.key_prefix}:{{{who.id}}}:*") == []  # nothing taken
    finally:
        client.close()
    await limiter.admit(who, 100)


async def test_keys_expire_when_the_bucket_would_be_full_again(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    limiter, who = limiters(), tenant(requests_per_s=10, tokens_per_min=6000)
    await limiter.admit(who, 100)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert 0 < client.pttl(f"{limiter.key_prefix}:{{{who.id}}}:rps") <= 100  # 1 × 0.1 s
        assert 0 < client.pttl(f"{limiter.key_prefix}:{{{who.id}}}:tpm") <= 1000  # 100 × 10 ms
    finally:
        client.close()


async def test_script_is_loaded_again_after_redis_forgets_it(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    limiter, who = limiters(), tenant(requests_per_s=100)
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.script_flush()
        await limiter.admit(who, 1)  # EVALSHA -> NOSCRIPT -> EVAL
        assert client.script_exists(GCRA.sha) == [True]
    finally:
        client.close()
    assert limiter.outages == 0


# --------------------------------------------------------------------------- Redis outage


async def test_redis_down_falls_back_to_rate_over_replicas_then_shares_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=QUOTA_LOG)
    server = EmbeddedRedis()
    server.start()
    clock = FakeClock()
    replicas = [
        TenantRateLimiter(server.url, replicas=2, clock=clock, redis_timeout_s=1.0)
        for _ in range(2)
    ]  # a refused connection fails at once; the long timeout only spares a loaded machine
    who = tenant(requests_per_s=10)  # shared: 10/s, burst 10; each replica alone: 5/s, burst 5
    try:
        assert await admitted(replicas[0], who, 1)
        server.stop()
        counts = [0, 0]
        for _ in range(200):  # 2 s of fake time, 3 tries per replica every 10 ms
            for i, limiter in enumerate(replicas):
                for _ in range(3):
                    counts[i] += await admitted(limiter, who, 1)
            clock.advance(0.01)
        assert all(13 <= n <= 15 for n in counts), counts  # burst 5 + 5/s × 2 s
        assert sum(counts) <= 10 * 2 + 10  # within the shared limit's bound
        assert all(limiter.degraded and limiter.outages == 1 for limiter in replicas)
        ours = [r for r in caplog.records if r.name == QUOTA_LOG]
        warnings = [r for r in ours if r.levelno == logging.WARNING]
        assert len(warnings) == 2  # one per replica, however many re-tries failed

        server.start()
        clock.advance(10.0)  # past the longest back-off
        first = 0
        for _ in range(100):
            if not await admitted(replicas[0], who, 1):
                break
            first += 1
        assert 10 <= first <= 12  # the shared burst (a fresh Redis), not one replica's share
        await refusal(replicas[1], who, 1)  # the other replica sees the same bucket
        assert not any(limiter.degraded for limiter in replicas)
        infos = [r for r in caplog.records if r.name == QUOTA_LOG and r.levelno == logging.INFO]
        assert len(infos) == 2 and all("back" in r.message for r in infos)
    finally:
        for limiter in replicas:
            await limiter.close()
        server.close()


async def test_unresponsive_redis_never_blocks_a_request_beyond_the_timeout(
    limiters: LimiterFactory,
) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", free_port()))
        silent.listen(8)
        port = silent.getsockname()[1]
        limiter = limiters(f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.05)
        who = tenant(requests_per_s=1000)
        start = time.monotonic()
        await limiter.admit(who, 1)
        assert time.monotonic() - start < 0.5  # 50 ms timeouts, not redis-py's retries
        assert limiter.degraded
        start = time.monotonic()
        for _ in range(100):  # inside the back-off: not even one more try
            await limiter.admit(who, 1)
        assert time.monotonic() - start < 0.25
