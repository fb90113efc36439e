"""Tenant quotas: shared rate limits at the edge, in-flight caps at the inner tiers.

``TenantRateLimiter`` enforces a tenant's ``requests_per_s`` and ``tokens_per_min``
across every replica of the global tier with GCRA in one Redis script;
``ConcurrencyCaps`` caps a tenant's requests in flight inside one process.

GCRA (the generic cell rate algorithm) keeps one number per limit, the
*theoretical arrival time* (TAT): when the bucket would be empty again. A
request of ``cost`` units at ``now`` conforms when

    max(TAT, now) + cost × interval − burst × interval ≤ now

(``interval`` = seconds per unit, ``burst`` = units that may arrive at once),
and then TAT becomes ``max(TAT, now) + cost × interval``. Over any window of
``t`` seconds at most ``burst + rate × t`` units conform; a request costing more
than ``burst`` never does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from common.basics.backoff import Backoff
from common.basics.errors import RouteError
from common.config.access import TenantConfig

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Reply = Awaitable[list[int]]

# Bursts: one second of requests, ten seconds of tokens (see request_burst/token_burst).
TOKEN_BURST_S = 10.0
# Re-try Redis after an outage no sooner than this, doubling up to the max.
RETRY_MIN_S = 0.5
RETRY_MAX_S = 5.0


def request_burst(requests_per_s: float) -> float:
    """Requests that may arrive at once: one second's worth, at least one."""
    return max(1.0, requests_per_s)


def token_burst(tokens_per_min: float) -> float:
    """Tokens that may arrive at once: ten seconds' worth (a sixth of the minute), at least one.

    Not the whole minute: a tenant could otherwise spend its minute in one
    instant, twice per minute at the window's edge.
    """
    return max(1.0, tokens_per_min * TOKEN_BURST_S / 60.0)


def gcra(tat: float, now: float, interval: float, burst: float, cost: float) -> tuple[float, float]:
    """One GCRA step: ``(new TAT, wait)``. ``wait == 0``: conforms, store the new TAT;
    else the request conforms in ``wait`` (same unit as ``now``) and TAT stays."""
    new_tat = max(tat, now) + cost * interval
    return new_tat, max(0.0, new_tat - burst * interval - now)


@dataclass(frozen=True, slots=True)
class Limit:
    """One of a tenant's rate limits, as GCRA sees it for one request."""

    name: str  # the config key: requests_per_s | tokens_per_min
    value: float  # as configured
    key: str  # suffix of the Redis key
    interval_s: float  # seconds per unit
    burst: float  # units
    cost: float  # units this request takes


def tenant_limits(tenant: TenantConfig, tokens: int) -> list[Limit]:
    """The limits that apply to one request of ``tokens`` (prompt + max_tokens).

    A request larger than the token burst could never conform, however long it
    waited; it is refused with INVALID_ARGUMENT (not RESOURCE_EXHAUSTED with a
    retry-after that would be a lie), saying what to change.
    """
    limits = []
    if tenant.requests_per_s is not None:
        rate = tenant.requests_per_s
        limits.append(Limit("requests_per_s", rate, "rps", 1 / rate, request_burst(rate), 1.0))
    if tenant.tokens_per_min is not None:
        tpm = tenant.tokens_per_min
        burst = token_burst(tpm)
        if tokens > burst:
            raise RouteError.invalid(
                f"request needs {tokens} tokens (prompt + max_tokens), more than tenant "
                f"'{tenant.id}' may ever send at once: its tokens_per_min limit ({tpm:g}) "
                f"allows bursts of {burst:g} tokens; lower max_tokens or shorten the prompt"
            )
        limits.append(Limit("tokens_per_min", tpm, "tpm", 60 / tpm, burst, float(tokens)))
    return limits


def raise_if_over(tenant: TenantConfig, limits: Sequence[Limit], waits: Sequence[float]) -> None:
    """Raise RESOURCE_EXHAUSTED naming each limit the request is over (``waits`` in
    seconds, one per limit); the retry-after is when it would conform to all."""
    over = [(limit, wait) for limit, wait in zip(limits, waits, strict=True) if wait > 0]
    if not over:
        return
    retry_after_ms = max(1, math.ceil(max(wait for _, wait in over) * 1000))
    names = " and its ".join(f"{limit.name} limit ({limit.value:g})" for limit, _ in over)
    raise RouteError.exhausted(
        f"tenant '{tenant.id}' is over its {names}; retry after {retry_after_ms} ms",
        retry_after_ms,
    )


# All limits of one request in one step, all or nothing: a request refused by one
# limit takes nothing from the other. Time is Redis's TIME, in µs, so every replica
# reads one clock (no skew between hosts). TATs are stored as integer µs strings
# with a PX expiry at the TAT: an idle tenant's keys vanish.
GCRA_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tats, waits, over = {}, {}, false
for i, key in ipairs(KEYS) do
  local interval = tonumber(ARGV[3 * i - 2])
  local tolerance = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then tat = now end
  tats[i] = tat + cost * interval
  local wait = tats[i] - tolerance - now
  if wait > 0 then
    waits[i] = math.ceil(wait)
    over = true
  else
    waits[i] = 0
  end
end
if not over then
  for i, key in ipairs(KEYS) do
    local ttl = math.max(1, math.ceil((tats[i] - now) / 1000))
    redis.call('SET', key, string.format('%.0f', tats[i]), 'PX', ttl)
  end
end
return waits
"""
GCRA_SHA = hashlib.sha1(GCRA_SCRIPT.encode()).hexdigest()


class TenantRateLimiter:
    """Per-tenant ``requests_per_s`` and ``tokens_per_min``, shared by all replicas.

    Algorithm: GCRA (module docstring) in one atomic Lua script (EVALSHA, EVAL on
    NOSCRIPT) over one key per limit, ``<key_prefix>:{<tenant>}:rps|tpm`` (the hash
    tag keeps both in one cluster slot). A request costs 1 against requests_per_s
    and ``tokens`` (prompt + max_tokens) against tokens_per_min; bursts are one
    second of requests and ten seconds of tokens. Over either limit:
    RESOURCE_EXHAUSTED naming the limit, with ``retry-after-ms`` = when it would
    conform; a request larger than the token burst: INVALID_ARGUMENT. A tenant
    with neither limit is admitted without touching Redis.

    Failure mode: a Redis call gets ``redis_timeout_s`` (50 ms) to connect and to
    answer, never a client-side retry. When it fails, this replica falls back to
    an in-process GCRA at ``rate / replicas`` with ``burst / replicas`` (at least
    the request's cost), so the replicas together stay near the shared limit; it
    logs one warning, serves from the fallback without touching Redis, and
    re-tries Redis with one request after a back-off (0.5 s doubling to 5 s).
    When Redis answers again it logs one info and drops the fallback state.

    Caches: only the fallback TATs, one float per tenant and limit, while degraded.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        replicas: int = 1,
        clock: Clock = time.time,
        key_prefix: str = "meridian:quota",
        redis_timeout_s: float = 0.05,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas!r}")
        self.replicas = replicas
        self.clock = clock
        self.key_prefix = key_prefix
        self.redis_timeout_s = redis_timeout_s
        self.redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=redis_timeout_s,
            socket_connect_timeout=redis_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self.degraded = False
        self.outages = 0  # times this replica fell back (for metrics and tests)
        # Re-trying Redis while degraded: RETRY_MIN_S doubling to RETRY_MAX_S.
        self._backoff = Backoff(RETRY_MIN_S, RETRY_MAX_S)
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._local: dict[str, float] = {}

    async def close(self) -> None:
        await self.redis.aclose()

    async def admit(self, tenant: TenantConfig, tokens: int) -> None:
        """Take one request of ``tokens`` from the tenant's limits, or raise RouteError."""
        limits = tenant_limits(tenant, tokens)
        if not limits:
            return
        if self._redis_due():
            try:
                waits = await self._admit_redis(tenant.id, limits)
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
                waits = self._admit_local(tenant.id, limits)
            else:
                self._redis_ok()
        else:
            waits = self._admit_local(tenant.id, limits)
        raise_if_over(tenant, limits, waits)

    def _redis_due(self) -> bool:
        if not self.degraded:
            return True
        now = self.clock()
        if now < self._retry_at:
            return False
        # This request probes Redis; the others stay local until it has answered.
        self._retry_at = now + self._backoff_s
        return True

    async def _admit_redis(self, tenant_id: str, limits: Sequence[Limit]) -> list[float]:
        keys = [f"{self.key_prefix}:{{{tenant_id}}}:{limit.key}" for limit in limits]
        args: list[str] = []
        for limit in limits:
            interval_us = limit.interval_s * 1e6
            args += [repr(interval_us), repr(limit.burst * interval_us), repr(limit.cost)]
        # Connect + EVALSHA (+ EVAL after a Redis restart): bounded as a whole too.
        async with asyncio.timeout(3 * self.redis_timeout_s):
            try:
                reply = await cast(Reply, self.redis.evalsha(GCRA_SHA, len(keys), *keys, *args))
            except NoScriptError:
                reply = await cast(Reply, self.redis.eval(GCRA_SCRIPT, len(keys), *keys, *args))
        return [int(wait_us) / 1e6 for wait_us in reply]

    def _admit_local(self, tenant_id: str, limits: Sequence[Limit]) -> list[float]:
        """GCRA in process at this replica's share of each limit; all or nothing."""
        now = self.clock()
        steps = []
        for limit in limits:
            key = f"{tenant_id}:{limit.key}"
            burst = max(limit.burst / self.replicas, limit.cost)
            interval = limit.interval_s * self.replicas
            steps.append((key, *gcra(self._local.get(key, now), now, interval, burst, limit.cost)))
        if all(wait == 0 for _, _, wait in steps):
            for key, tat, _ in steps:
                self._local[key] = tat
        return [wait for _, _, wait in steps]

    def _redis_failed(self, exc: BaseException) -> None:
        if not self.degraded:
            self.degraded = True
            self.outages += 1
            self._backoff.reset()
            self._backoff_s = self._backoff.next_s()
            log.warning(
                "quota: redis unavailable (%s); limiting in process at 1/%d of each tenant's "
                "limit, re-trying redis with back-off",
                exc.__class__.__name__,
                self.replicas,
            )
        else:
            self._backoff_s = self._backoff.next_s()
        self._retry_at = self.clock() + self._backoff_s

    def _redis_ok(self) -> None:
        if self.degraded:
            log.info("quota: redis is back; tenant limits are shared again")
            self.degraded = False
            self._backoff.reset()
            self._backoff_s = 0.0
            self._local.clear()


class ConcurrencyCaps:
    """Per-tenant requests in flight in this process, capped at ``max_concurrent``.

    Counts every tenant (uncapped ones too) so ``in_flight`` is always true; an
    entry is dropped when it reaches zero, so idle tenants cost nothing. O(1),
    synchronous, one event loop. A release without an acquire is ignored: the
    count never goes negative. When a slot frees cannot be known, so the
    ``retry-after-ms`` on a refusal is a fixed hint (``retry_after_ms``).
    """

    def __init__(self, *, retry_after_ms: int = 100) -> None:
        self.retry_after_ms = retry_after_ms
        self._in_flight: dict[str, int] = {}

    def acquire(self, tenant: TenantConfig) -> None:
        n = self._in_flight.get(tenant.id, 0)
        if tenant.max_concurrent is not None and n >= tenant.max_concurrent:
            raise RouteError.exhausted(
                f"tenant '{tenant.id}' has {n} requests in flight, its limit (max_concurrent); "
                "retry when one finishes",
                self.retry_after_ms,
            )
        self._in_flight[tenant.id] = n + 1

    def release(self, tenant_id: str) -> None:
        n = self._in_flight.get(tenant_id, 0)
        if n > 1:
            self._in_flight[tenant_id] = n - 1
        else:
            self._in_flight.pop(tenant_id, None)

    def in_flight(self, tenant_id: str) -> int:
        return self._in_flight.get(tenant_id, 0)
