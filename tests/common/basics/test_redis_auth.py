"""Every Redis user works with a password-protected Redis given by URL."""

import asyncio

import pytest
import redis

from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import CapacityPublisher, CapacityReader, zone_stream
from common.config.access import TenantConfig
from common.gen.meridian.v1 import capacity_pb2
from common.tenancy.quota import TenantRateLimiter
from common.tenancy.usage import UsageRecord, UsageRecorder, summarise


@pytest.fixture
def locked_redis():  # type: ignore[no-untyped-def]
    server = EmbeddedRedis(password="s3cret-pass")
    server.start()
    try:
        yield server
    finally:
        server.close()


def test_a_url_without_the_password_is_refused(locked_redis: EmbeddedRedis) -> None:
    bare = redis.Redis.from_url(f"redis://127.0.0.1:{locked_redis.port}/0")
    with pytest.raises(redis.AuthenticationError):
        bare.ping()
    bare.close()


async def test_summaries_quotas_and_usage_with_a_password(locked_redis: EmbeddedRedis) -> None:
    url = locked_redis.url
    stream = zone_stream("r", "z")
    got: list[capacity_pb2.CapacitySummary] = []
    publisher = CapacityPublisher(
        url,
        stream,
        lambda seq: capacity_pb2.CapacitySummary(sequence=seq),
        cadence_s=0.05,
        maxlen=10,
    )
    reader = CapacityReader(url, {stream: "z"}, lambda _, s: got.append(s), block_ms=100)
    recorder = UsageRecorder(url)
    limiter = TenantRateLimiter(url, redis_timeout_s=0.5)
    publisher.start()
    reader.start()
    recorder.start()
    try:
        await limiter.admit(TenantConfig(id="t", key_hashes=frozenset(), requests_per_s=5), 10)
        assert not limiter.degraded
        recorder.record(UsageRecord("t", "m", "r", "z", "g", 1, 2, 0.1, "OK", "", "id1", 1))
        await recorder.flush()
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.05)
        assert got
        totals = await summarise(url, since_ms=None, until_ms=None)
        assert totals[("t", "m")].requests == 1
    finally:
        await publisher.stop()
        await reader.stop()
        await recorder.stop()
        await limiter.close()
