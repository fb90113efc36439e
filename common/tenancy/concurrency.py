"""A tenant's ``max_concurrent``, held across every replica of the edge by leases in Redis.

The edge owns the cap (inner tiers do not count at all): a request takes a
lease before it is forwarded and gives it back when it ends, so the cap holds
wherever the request runs and a refusal is never an inner tier's to fail over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from common.basics.errors import RouteError
from common.config.access import TenantConfig
from common.request.streaming import Release, no_release
from common.tenancy.quota import RateCheck
from common.tenancy.quota_scripts import ADMIT, OVER_CAP, SYNC
from common.tenancy.shared_redis import (
    Clock,
    QuotaRedis,
    RedisDown,
    raise_lost_cancel,
    shared_or_own,
)

log = logging.getLogger(__name__)

# How long a lease outlives its last renewal: a crashed replica's leases are gone by then.
LEASE_TTL_S = 5.0
# Renewals per TTL: a lease survives RENEWALS - 1 missed ones (Redis slow, loop busy).
RENEWALS = 5
LIMIT = "max_concurrent"


@dataclass
class Leases:
    """One tenant's leases at this replica."""

    live: set[str] = field(default_factory=set)
    # Given back here, their removal from Redis not yet confirmed.
    released: set[str] = field(default_factory=set)


class TenantConcurrency:
    """``max_concurrent`` per tenant across all edge replicas: leases in Redis.

    Algorithm: each admitted request holds a lease, a unique id in the sorted set
    ``<key_prefix>:{<tenant>}:leases`` scored by its expiry. ``acquire`` runs one
    Lua script (``ADMIT``, with the request's rate limits when it has any, so the
    edge admits a request in one round trip): drop expired leases, count, add the
    new one if the count is under the cap, else RESOURCE_EXHAUSTED with
    ``retry-after-ms`` (a fixed hint: when a slot frees cannot be known) and
    ``x-meridian-quota: max_concurrent``, so no tier fails it over. The ``Release``
    it returns gives the lease back exactly once, however often it is called; a
    call that ends in any way (ok, error, cancellation) calls it. A keeper task
    removes released leases from Redis at once (in the same pipeline as the
    acquires of that loop turn, ``common.tenancy.script_batch``; an acquire also
    carries the releases it finds) and renews live ones every ``lease_ttl_s / 5``
    (expiry ``lease_ttl_s``, 5 s), so a long call keeps its lease and a crashed
    replica's leases vanish within ``lease_ttl_s`` (meanwhile the cap is stricter,
    never looser).

    Failure mode: Redis calls go through ``QuotaRedis`` (bounded, one retry on a
    new connection: a broken pooled connection never flips it). While Redis is
    down each replica caps the tenant at ``ceil(max_concurrent / replicas)`` of its
    own requests in flight (the ones it admitted through Redis count), so the fleet
    stays within ``replicas × ceil(max / replicas)``. The first call that reaches
    Redis again, and the first after a reconnect (a restart may have emptied
    Redis), first puts this replica's live leases back and removes its released
    ones; other replicas' live leases return at their next renewal (within
    ``lease_ttl_s / 5``), the only window in which the shared count can be low.

    Caches: this replica's live and released lease ids per tenant (tenants from
    config), dropped once Redis has confirmed the releases.
    """

    def __init__(
        self,
        redis: str | QuotaRedis,
        *,
        replicas: int = 1,
        clock: Clock = time.time,
        key_prefix: str = "meridian:concurrency",
        redis_timeout_s: float = 0.05,
        lease_ttl_s: float = LEASE_TTL_S,
        retry_after_ms: int = 100,
    ) -> None:
        """``redis``: a URL (a client of its own) or the edge's ``QuotaRedis``, shared
        with its rate limits (then ``redis_timeout_s`` is that client's, and its owner
        closes it)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas!r}")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
        self.replicas = replicas
        self.key_prefix = key_prefix
        self.lease_ttl_ms = max(1, round(lease_ttl_s * 1000))
        self.renew_every_s = lease_ttl_s / RENEWALS
        self.retry_after_ms = retry_after_ms
        self._owns_redis = isinstance(redis, str)
        self.shared = shared_or_own(
            redis,
            what="concurrency",
            fallback=f"capping each tenant at 1/{replicas} of max_concurrent in process",
            timeout_s=redis_timeout_s,
            clock=clock,
        )
        # Lease ids: this replica's random prefix and a serial (unique without a
        # uuid4, that is an os.urandom call, per request).
        self._lease_ids = map(f"{uuid.uuid4().hex[:16]}-{{}}".format, itertools.count())
        self._tenants: dict[str, Leases] = {}
        self._synced_reconnects = 0
        self._sync_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def degraded(self) -> bool:
        return self.shared.degraded

    @property
    def outages(self) -> int:
        return self.shared.outages

    def in_flight(self, tenant_id: str) -> int:
        """The tenant's requests in flight admitted by this replica."""
        leases = self._tenants.get(tenant_id)
        return len(leases.live) if leases else 0

    def key(self, tenant_id: str) -> str:
        return f"{self.key_prefix}:{{{tenant_id}}}:leases"

    async def acquire(self, tenant: TenantConfig, rates: RateCheck | None = None) -> Release:
        """A lease for one request (the release to call when it ends), or RouteError.

        ``rates``: the request's rate limits, taken in the same script as the lease
        (``ADMIT``: one round trip, all or nothing, the cap looked at first)."""
        cap = tenant.max_concurrent
        if cap is None:
            if rates is not None:
                await rates.admit()
            return no_release
        self._start_keeper()
        lease, reply = next(self._lease_ids), None
        if self.shared.due():
            try:
                reply = await self._acquire_shared(tenant.id, lease, cap, rates)
                raise_lost_cancel()
            except BaseException:
                reply = None
                raise
            finally:
                if reply is None:  # failed or cancelled: the lease may have reached Redis
                    self._leases(tenant.id).released.add(lease)
                    self._wake.set()
        if reply is None:  # Redis is down: counted in process
            return self._acquire_in_process(tenant, cap, rates)
        outcome, held = int(reply[0]), int(reply[1])
        if outcome == OVER_CAP:
            raise self._over_cap(tenant, cap, held)
        if rates is not None:
            rates.answered(reply[2:])  # raises when over a rate: then no lease was added
        self._leases(tenant.id).live.add(lease)
        return self._release_of(tenant.id, lease)

    def _acquire_in_process(
        self, tenant: TenantConfig, cap: int, rates: RateCheck | None
    ) -> Release:
        """While Redis is down: this replica's share of the cap, then the rates' share."""
        held = self._acquire_local(tenant.id, cap)
        if held < 0:
            raise self._over_cap(tenant, cap, -held)
        if rates is not None:
            rates.in_process()
        lease = next(self._lease_ids)
        self._leases(tenant.id).live.add(lease)
        return self._release_of(tenant.id, lease)

    def _over_cap(self, tenant: TenantConfig, cap: int, held: int) -> RouteError:
        return RouteError.over_quota(
            f"tenant '{tenant.id}' has {held} requests in flight, its limit ({LIMIT} "
            f"{cap}); retry when one finishes",
            self.retry_after_ms,
            LIMIT,
        )

    async def _acquire_shared(
        self, tenant_id: str, lease: str, cap: int, rates: RateCheck | None
    ) -> list[int] | None:
        """``ADMIT``'s reply; None: Redis is down. The released leases it carries are
        gone from Redis once it answered."""
        try:
            if self._resync_pending():
                await self.sync(renew=True)  # ours back first: the count must include them
            leases = self._tenants.get(tenant_id)
            gone = list(leases.released) if leases is not None else []
            keys, args = [self.key(tenant_id)], [lease, str(cap), str(self.lease_ttl_ms), *gone]
            if rates is not None:
                keys, args = [*rates.keys, *keys], [*rates.args, *args]
            reply = await self.shared.run(
                ADMIT, keys, args, reconnected=lambda: self.sync(renew=True)
            )
        except RedisDown:
            return None
        if gone:
            self._leases(tenant_id).released.difference_update(gone)
        return reply

    def _resync_pending(self) -> bool:
        """Redis was down, or a call found its connection broken (a restart may have
        emptied it): this replica's live leases must be put back."""
        return self.shared.degraded or self.shared.reconnects != self._synced_reconnects

    def _acquire_local(self, tenant_id: str, cap: int) -> int:
        share = math.ceil(cap / self.replicas)
        held = self.in_flight(tenant_id)
        return held + 1 if held < share else -held

    def _leases(self, tenant_id: str) -> Leases:
        return self._tenants.setdefault(tenant_id, Leases())

    def _release_of(self, tenant_id: str, lease: str) -> Release:
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            leases = self._leases(tenant_id)
            leases.live.discard(lease)
            leases.released.add(lease)
            self._wake.set()

        return release

    async def sync(self, *, renew: bool) -> None:
        """Remove released leases from Redis and, with ``renew``, add or renew the live
        ones; one script per tenant, one sync at a time. RedisDown."""
        async with self._sync_lock:
            reconnects = self.shared.reconnects
            renew = renew or self.shared.degraded
            for tenant_id, leases in list(self._tenants.items()):
                gone, live = list(leases.released), list(leases.live) if renew else []
                if gone or live:
                    args = [str(self.lease_ttl_ms), str(len(gone)), *gone, *live]
                    await self.shared.run(SYNC, [self.key(tenant_id)], args)
                    leases.released.difference_update(gone)
                if not leases.live and not leases.released:
                    self._tenants.pop(tenant_id, None)
            if renew:
                self._synced_reconnects = max(self._synced_reconnects, reconnects)

    def _start_keeper(self) -> None:
        if self._keeper is None:
            self._keeper = asyncio.create_task(self._keep(), name="concurrency-lease-keeper")

    async def _keep(self) -> None:
        """Releases out at once, renewals on their cadence, and at once after a reconnect."""
        loop = asyncio.get_running_loop()
        renew_at = loop.time() + self.renew_every_s
        while not self._closing:
            if not self._resync_pending() or self.shared.degraded:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, renew_at - loop.time())):
                        await self._wake.wait()
            self._wake.clear()
            renew = self._resync_pending() or loop.time() >= renew_at
            if renew:
                renew_at = loop.time() + self.renew_every_s
            if self.shared.due():
                with contextlib.suppress(RedisDown):
                    await self.sync(renew=renew)

    async def close(self) -> None:
        """Stop the keeper; give back every lease still here (best effort); close Redis."""
        self._closing = True
        if self._keeper is not None:
            # Not cancelled: a cancellation may be lost inside redis-py (raise_lost_cancel).
            self._wake.set()
            await self._keeper
            self._keeper = None
        for leases in self._tenants.values():
            leases.released |= leases.live
            leases.live.clear()
        if not self.shared.degraded:
            with contextlib.suppress(RedisDown):
                await self.sync(renew=False)
        if self._owns_redis:
            await self.shared.close()
