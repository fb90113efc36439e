"""Tenant rate limits, shared by every replica of the edge (the global tier).

``TenantRateLimiter`` enforces a tenant's ``requests_per_s`` and ``tokens_per_min``
across every replica of the global tier with GCRA in one Redis script (its
``max_concurrent`` is ``common.tenancy.concurrency``'s).

GCRA (the generic cell rate algorithm) keeps one number per limit, the
*theoretical arrival time* (TAT): when the bucket would be empty again. A
request of ``cost`` units at ``now`` conforms when

    max(TAT, now) + cost × interval − burst × interval ≤ now

(``interval`` = seconds per unit, ``burst`` = units that may arrive at once),
and then TAT becomes ``max(TAT, now) + cost × interval``. Over any window of
``t`` seconds at most ``burst + rate × t`` units conform; a request costing more
than ``burst`` never does.

A request is charged an estimate of its tokens at admission (prompt words +
``max_tokens``: what it may cost at most). Once it ended and its GPU reported
what it really cost, ``settle`` moves the TAT by the difference: a request that
asked for 1000 tokens and got 10 gives 990 back, one that cost more than its
estimate (a longer tokenised prompt) pays the rest, after the fact. A refund
stops at a full bucket (TAT = now): never more than the burst.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from common.basics.errors import RouteError
from common.config.access import TenantConfig
from common.tenancy.quota_scripts import GCRA, SETTLE
from common.tenancy.shared_redis import (
    Clock,
    QuotaRedis,
    RedisDown,
    raise_lost_cancel,
    shared_or_own,
)

# Bursts: one second of requests, ten seconds of tokens (see request_burst/token_burst).
TOKEN_BURST_S = 10.0


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
    raise RouteError.over_quota(
        f"tenant '{tenant.id}' is over its {names}; retry after {retry_after_ms} ms",
        retry_after_ms,
        ",".join(limit.name for limit, _ in over),
    )


class TenantRateLimiter:
    """Per-tenant ``requests_per_s`` and ``tokens_per_min``, shared by all replicas.

    Algorithm: GCRA (module docstring) in one atomic Lua script (EVALSHA, EVAL on
    NOSCRIPT; for a tenant with ``max_concurrent`` too, inside its lease's script,
    ``common.tenancy.concurrency``) over one key per limit,
    ``<key_prefix>:{<tenant>}:rps|tpm`` (the hash tag keeps both in one cluster
    slot). A request costs 1 against requests_per_s
    and ``tokens`` (prompt + max_tokens) against tokens_per_min; bursts are one
    second of requests and ten seconds of tokens; ``settle`` later moves the
    tokens_per_min TAT to the request's real count (module docstring). Over either limit:
    RESOURCE_EXHAUSTED naming the limit, with ``retry-after-ms`` = when it would
    conform and ``x-meridian-quota`` (never failed over); a request larger than
    the token burst: INVALID_ARGUMENT. A tenant with neither limit is admitted
    without touching Redis.

    Failure mode (``QuotaRedis``): bounded calls, one retry on a new connection,
    so a broken pooled connection never flips it. When Redis is down this replica
    limits in process at ``rate / replicas`` with ``burst / replicas`` (at least
    the request's cost), so the replicas together stay near the shared limit, and
    re-tries Redis after a back-off.

    The fallback keeps its bucket across flips: every Redis reply sets this
    replica's copy of each TAT to where the shared one is (TAT − now, added to the
    time the call was sent, so the copy never runs ahead of the shared TAT), and the
    copy is never cleared. Measured as TAT − now, a bucket is the same fraction
    full at the shared scale and at a replica's share, so a fallback starts where
    the shared state was, never from a full burst. Back on Redis, the copy is the
    script's floor: it raises a TAT a restarted Redis lost, and the first call
    after admitting in process forces it over a stored TAT that missed those
    admissions. Bound: across an outage (Redis down, restarted empty, or its
    connections killed) the fleet admits at most one burst more than the limit
    (``burst + rate × t`` units in any ``t`` seconds); that burst is what replicas
    whose copy was older than the shared state may hand out in process (with one
    replica: nothing), and a fresh burst from a restarted Redis never comes on top.

    Caches: that copy, one float per tenant and limit (tenants come from config),
    and which copies took steps in process since their last Redis reply.
    """

    def __init__(
        self,
        redis: str | QuotaRedis,
        *,
        replicas: int = 1,
        clock: Clock = time.time,
        key_prefix: str = "meridian:quota",
        redis_timeout_s: float = 0.05,
    ) -> None:
        """``redis``: a URL (a client of its own) or the edge's ``QuotaRedis``, shared
        with its leases (then ``redis_timeout_s`` is that client's, and it closes it)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas!r}")
        self.replicas = replicas
        self.clock = clock
        self.key_prefix = key_prefix
        self._owns_redis = isinstance(redis, str)
        self.shared = shared_or_own(
            redis,
            what="quota",
            fallback=f"limiting in process at 1/{replicas} of each tenant's limit",
            timeout_s=redis_timeout_s,
            clock=clock,
        )
        # This replica's copy of each TAT ("<tenant>:rps|tpm"), in its own clock.
        self._local: dict[str, float] = {}
        # Copies that admitted in process since Redis last took their floor.
        self._unsynced: set[str] = set()

    @property
    def degraded(self) -> bool:
        return self.shared.degraded

    @property
    def outages(self) -> int:
        """Times this replica fell back (for metrics and tests)."""
        return self.shared.outages

    async def close(self) -> None:
        if self._owns_redis:
            await self.shared.close()

    async def admit(self, tenant: TenantConfig, tokens: int) -> None:
        """Take one request of ``tokens`` from the tenant's limits, or raise RouteError."""
        check = self.check(tenant, tokens)
        if check is not None:
            await check.admit()

    def check(self, tenant: TenantConfig, tokens: int) -> RateCheck | None:
        """One request's limits, ready to send (None: the tenant has none); raises
        INVALID_ARGUMENT for a request larger than its token burst."""
        limits = tenant_limits(tenant, tokens)
        if not limits:
            return None
        keys = [f"{self.key_prefix}:{{{tenant.id}}}:{limit.key}" for limit in limits]
        copies = [f"{tenant.id}:{limit.key}" for limit in limits]
        sent = self.clock()
        args: list[str] = []
        for limit, copy in zip(limits, copies, strict=True):
            interval_us = limit.interval_s * 1e6
            tolerance_us = limit.burst * interval_us
            ahead_us = (self._local.get(copy, sent) - sent) * 1e6
            floor_us = min(max(0.0, ahead_us), tolerance_us)
            force = "1" if copy in self._unsynced else "0"
            args += [repr(interval_us), repr(tolerance_us), repr(limit.cost), repr(floor_us), force]
        return RateCheck(self, tenant, limits, keys, args, copies, sent)

    def _answered(self, check: RateCheck, reply: Sequence[int]) -> list[float]:
        """The waits (seconds, one per limit; 0: conforms) in GCRA's reply to ``check``;
        this replica's copies of the TATs are set from it."""
        waits = [int(reply[2 * i]) / 1e6 for i in range(len(check.copies))]
        for i, copy in enumerate(check.copies):
            self._local[copy] = check.sent + int(reply[2 * i + 1]) / 1e6
        if all(wait == 0 for wait in waits):  # stored: Redis has what the copies had
            self._unsynced.difference_update(check.copies)
        return waits

    async def settle(self, tenant: TenantConfig, tokens: int) -> None:
        """Charge ``tokens`` more (negative: give them back) to the tenant's
        tokens_per_min, once a request's real count is known (see ``SETTLE``). Never
        raises for Redis: while it is down the difference goes to this replica's copy."""
        if tenant.tokens_per_min is None or tokens == 0:
            return
        interval_us = 60e6 / tenant.tokens_per_min
        shift_us = tokens * interval_us
        copy = f"{tenant.id}:tpm"
        if self.shared.due():
            key = f"{self.key_prefix}:{{{tenant.id}}}:tpm"
            sent = self.clock()
            ahead_us = (self._local.get(copy, sent) - sent) * 1e6
            floor_us = min(max(0.0, ahead_us), token_burst(tenant.tokens_per_min) * interval_us)
            force = copy in self._unsynced
            args = [repr(shift_us), repr(floor_us), "1" if force else "0"]
            reply: list[int] | None = None
            with contextlib.suppress(RedisDown):
                reply = await self.shared.run(SETTLE, [key], args)
            raise_lost_cancel()
            if reply is not None:
                self._local[copy] = sent + int(reply[0]) / 1e6
                self._unsynced.discard(copy)  # forced: Redis has what the copy had
                return
        # In process, at this replica's share (as _admit_local steps it).
        now = self.clock()
        tat = max(self._local.get(copy, now), now) + shift_us / 1e6 * self.replicas
        self._local[copy] = max(tat, now)
        if tokens > 0:  # raise the shared TAT by it when Redis is back
            self._unsynced.add(copy)

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
                self._unsynced.add(key)
        return [wait for _, _, wait in steps]


@dataclass(slots=True)
class RateCheck:
    """One request's rate limits at this replica, checked in one of three ways: alone
    in Redis (``admit``), inside another script that runs GCRA on ``keys`` and ``args``
    (the edge's lease, ``common.tenancy.concurrency``) and then ``answered``, or in
    process while Redis is down (``in_process``). Each takes the request from every
    limit or raises RouteError naming those it is over."""

    limiter: TenantRateLimiter
    tenant: TenantConfig
    limits: list[Limit]
    keys: list[str]
    args: list[str]  # five per limit (see GCRA)
    copies: list[str]  # this replica's copy of each limit's TAT
    sent: float  # the limiter's clock when ``args`` were worked out

    async def admit(self) -> None:
        waits = None
        limiter = self.limiter
        if limiter.shared.due():
            try:
                reply = await limiter.shared.run(GCRA, self.keys, self.args)
                waits = limiter._answered(self, reply)
            except RedisDown:
                pass
            raise_lost_cancel()
        if waits is None:
            waits = limiter._admit_local(self.tenant.id, self.limits)
        raise_if_over(self.tenant, self.limits, waits)

    def answered(self, reply: Sequence[int]) -> None:
        """GCRA's part of another script's reply."""
        raise_if_over(self.tenant, self.limits, self.limiter._answered(self, reply))

    def in_process(self) -> None:
        waits = self.limiter._admit_local(self.tenant.id, self.limits)
        raise_if_over(self.tenant, self.limits, waits)
