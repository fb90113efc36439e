"""Settling tokens_per_min on real counts (``TenantRateLimiter.settle``, ``QuotaSettler``,
``Admission.call_ended``) against the real embedded Redis: the bucket moves by exactly
the difference, a refund never overfills it, the usage record says whether the counts
were the server's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import redis

from common.basics.errors import RouteError
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.access import AuthConfig, TenantConfig
from common.request.call import CallRecord
from common.request.routing import RouteHints
from common.tenancy.admission import Admission, edge_admission
from common.tenancy.quota import TenantRateLimiter
from common.tenancy.settle import QuotaSettler
from common.tenancy.usage import USAGE_STREAM, UsageRecord
from tests.common.tenancy.test_admission import edge_hints, key_of, pick
from tests.common.tenancy.test_admission import tenant as keyed_tenant
from tests.common.tenancy.test_quota import LimiterFactory, admitted, limiters, tenant

__all__ = ["limiters"]  # the fixture, shared with test_quota

# 600 tokens/min: 0.1 s (100 000 µs) per token, bursts of 100 tokens.
TPM, US_PER_TOKEN, BURST = 600, 100_000, 100


def tat_and_ttl(limiter: TenantRateLimiter, tenant_id: str, url: str) -> tuple[int | None, int]:
    """The tokens_per_min TAT (µs) stored in Redis and its key's PX TTL (ms; -2: no key)."""
    client = redis.Redis.from_url(url)
    try:
        key = f"{limiter.key_prefix}:{{{tenant_id}}}:tpm"
        raw: Any = client.get(key)
        ttl: Any = client.pttl(key)
        return (int(raw) if raw is not None else None), int(ttl)
    finally:
        client.close()


async def test_a_refund_moves_the_tat_back_by_exactly_the_difference(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    """Asked 4 + 90, got 4 + 5: 85 tokens back, to the microsecond."""
    limiter, who = limiters(), tenant(tokens_per_min=TPM)
    await limiter.admit(who, 94)
    charged, _ = tat_and_ttl(limiter, who.id, redis_server.url)
    await limiter.settle(who, 9 - 94)
    settled, ttl = tat_and_ttl(limiter, who.id, redis_server.url)
    assert charged is not None and settled is not None
    assert charged - settled == 85 * US_PER_TOKEN
    assert 0 < ttl <= 9 * US_PER_TOKEN // 1000  # the key now expires with the smaller TAT


async def test_a_charge_moves_the_tat_on_by_exactly_the_difference(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    limiter, who = limiters(), tenant(tokens_per_min=TPM)
    await limiter.admit(who, 10)
    charged, _ = tat_and_ttl(limiter, who.id, redis_server.url)
    await limiter.settle(who, 20)  # the prompt tokenised longer than its words
    settled, _ = tat_and_ttl(limiter, who.id, redis_server.url)
    assert charged is not None and settled is not None
    assert settled - charged == 20 * US_PER_TOKEN


async def test_a_refund_never_fills_the_bucket_past_its_burst(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    limiter, who = limiters(), tenant(tokens_per_min=TPM)
    await limiter.admit(who, 10)
    await limiter.settle(who, -1000)
    assert tat_and_ttl(limiter, who.id, redis_server.url) == (None, -2)  # full: no key
    assert await admitted(limiter, who, BURST)  # one burst, no more
    assert not await admitted(limiter, who, 5)


async def test_a_settlement_after_redis_lost_the_bucket_gives_no_fresh_burst(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    """The key gone (a Redis restarted empty): the settlement starts from where this
    replica last saw the bucket, as an admission would, not from a full one."""
    limiter, who = limiters(), tenant(tokens_per_min=TPM)
    await limiter.admit(who, 90)  # 9 s of tokens taken
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.delete(f"{limiter.key_prefix}:{{{who.id}}}:tpm")
        await limiter.settle(who, 5)
        seconds, micros = client.time()
    finally:
        client.close()
    tat, _ = tat_and_ttl(limiter, who.id, redis_server.url)
    assert tat is not None
    ahead_s = (tat - (seconds * 1_000_000 + micros)) / 1e6
    assert 9.0 <= ahead_s <= 9.5  # 9 s the replica knew of + the 0.5 s charged
    assert not await admitted(limiter, who, 10)


async def test_while_redis_is_down_the_difference_goes_to_the_replicas_copy(
    limiters: LimiterFactory,
) -> None:
    limiter = limiters(f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=0.05)
    who = tenant(tokens_per_min=TPM)
    await limiter.admit(who, 94)  # in process: Redis is unreachable
    assert limiter.degraded
    assert not await admitted(limiter, who, 90)
    await limiter.settle(who, -85)
    assert await admitted(limiter, who, 90)  # 9 + 90 <= 100


# --------------------------------------------------------------------------- QuotaSettler


async def test_the_settler_adds_up_a_tenants_differences_and_settles_them_once(
    limiters: LimiterFactory, redis_server: EmbeddedRedis
) -> None:
    limiter, who = limiters(), tenant(tokens_per_min=TPM)
    settler = QuotaSettler(limiter)
    for _ in range(3):
        await limiter.admit(who, 30)
    charged, _ = tat_and_ttl(limiter, who.id, redis_server.url)
    for refund in (-25, -20, 0):
        settler.add(who, refund)
    settler.add(tenant(), -50)  # no tokens_per_min: nothing to settle
    assert settler.pending == 2
    await settler.stop()  # never started: stop settles what is pending
    settled, _ = tat_and_ttl(limiter, who.id, redis_server.url)
    assert charged is not None and settled is not None
    assert charged - settled == 45 * US_PER_TOKEN
    assert (settler.pending, settler.settled, settler.refunded, settler.charged) == (0, 2, 45, 0)


async def test_the_settler_settles_in_the_background(limiters: LimiterFactory) -> None:
    limiter, who = limiters(), tenant(tokens_per_min=TPM)
    settler = QuotaSettler(limiter, flush_interval_s=0.01)
    settler.start()
    try:
        await limiter.admit(who, 94)
        assert not await admitted(limiter, who, 90)
        settler.add(who, -85)
        deadline = time.monotonic() + 5
        while settler.settled < 1:
            assert time.monotonic() < deadline, "never settled"
            await asyncio.sleep(0.01)
        assert await admitted(limiter, who, 90)
    finally:
        await settler.stop()


# --------------------------------------------------------------------------- Admission


@pytest.fixture
async def edge(redis_server: EmbeddedRedis) -> AsyncIterator[tuple[Admission, TenantConfig]]:
    who = keyed_tenant(tokens_per_min=TPM)
    admission = edge_admission(AuthConfig(enabled=True, tenants=(who,)), redis_server.url)
    await admission.start()
    try:
        yield admission, who
    finally:
        await admission.stop()


def ended(
    admission: Admission,
    hints: RouteHints,
    charged: int,
    counts: tuple[int, int],
    *,
    reported: bool,
) -> CallRecord:
    """Hand ``admission`` a finished call that took ``charged`` and cost ``counts``."""
    call = CallRecord("ModelInfer", (), time.monotonic(), hints=hints)
    call.model, call.code = "demo-llm", grpc.StatusCode.OK
    call.tokens_charged = charged
    call.prompt_tokens, call.completion_tokens = counts
    call.tokens_reported = reported
    admission.call_ended(call)
    return call


def records_of(url: str, tenant_id: str) -> list[UsageRecord]:
    client = redis.Redis.from_url(url)
    try:
        entries: Any = client.xrange(USAGE_STREAM)
    finally:
        client.close()
    records = [UsageRecord.from_fields(f) for _, f in entries]
    return [r for r in records if r.tenant == tenant_id]


async def test_admission_charges_the_estimate_and_settles_the_reported_count(
    edge: tuple[Admission, TenantConfig], redis_server: EmbeddedRedis
) -> None:
    admission, who = edge
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    call = CallRecord("ModelInfer", (), time.monotonic(), hints=hints)
    await admission.admit(hints, pick(prompt_tokens=4, max_tokens=90), call)
    assert call.tokens_charged == 94
    assert admission.limiter is not None and admission.settler is not None
    charged, _ = tat_and_ttl(admission.limiter, who.id, redis_server.url)
    ended(admission, hints, 94, (4, 5), reported=True)
    assert admission.settler.pending == 1
    await admission.settler.flush()
    settled, _ = tat_and_ttl(admission.limiter, who.id, redis_server.url)
    assert charged is not None and settled is not None
    assert charged - settled == 85 * US_PER_TOKEN
    assert admission.usage is not None
    await admission.usage.flush()
    [record] = records_of(redis_server.url, who.id)
    assert (record.prompt_tokens, record.completion_tokens, record.tokens_reported) == (4, 5, True)


async def test_admission_leaves_the_estimate_when_nothing_was_reported(
    edge: tuple[Admission, TenantConfig], redis_server: EmbeddedRedis
) -> None:
    admission, who = edge
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    call = CallRecord("ModelInfer", (), time.monotonic(), hints=hints)
    await admission.admit(hints, pick(prompt_tokens=4, max_tokens=90), call)
    ended(admission, hints, call.tokens_charged, (4, 90), reported=False)
    assert admission.settler is not None and admission.settler.pending == 0
    with pytest.raises(RouteError) as refused:  # 94 still taken: 94 + 10 > 100
        await admission.admit(hints, pick(prompt_tokens=4, max_tokens=6))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert admission.usage is not None
    await admission.usage.flush()
    [record] = records_of(redis_server.url, who.id)
    assert (record.prompt_tokens, record.completion_tokens, record.tokens_reported) == (
        4,
        90,
        False,
    )


async def test_a_tenant_without_tokens_per_min_is_charged_nothing(
    redis_server: EmbeddedRedis,
) -> None:
    who = keyed_tenant(requests_per_s=100)
    admission = edge_admission(AuthConfig(enabled=True, tenants=(who,)), redis_server.url)
    hints = admission.identify(key_of(who), edge_hints(key_of(who)))
    call = CallRecord("ModelInfer", (), time.monotonic(), hints=hints)
    try:
        await admission.admit(hints, pick(prompt_tokens=4, max_tokens=90), call)
        assert call.tokens_charged == 0
    finally:
        await admission.stop()
