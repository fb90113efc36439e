"""Settling token quotas on what requests really cost, off the request path.

At admission the edge charges a request's estimate (prompt words + ``max_tokens``)
to its tenant's ``tokens_per_min``; when the request has ended and its GPU
reported the real count, the difference is charged or given back
(``TenantRateLimiter.settle``). The caller's answer never waits for that Redis
call: ``QuotaSettler.add`` only adds the difference to the tenant's pending sum,
and a background task settles the sums every ``flush_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from common.config.access import TenantConfig
from common.tenancy.quota import TenantRateLimiter

log = logging.getLogger(__name__)


class QuotaSettler:
    """Pending token differences per tenant, settled in the background.

    ``add`` is synchronous and O(1); differences of one tenant add up until the
    next flush, so memory is one entry per tenant with requests that ended since
    (tenants come from config), and a flush makes one Redis call per tenant, not
    per request. ``settle`` never raises for Redis (its fallback counts in
    process), so nothing waits to be retried; ``stop`` settles what is pending.
    Counters: ``settled`` (requests), ``refunded`` and ``charged`` (tokens).
    """

    def __init__(self, limiter: TenantRateLimiter, *, flush_interval_s: float = 0.05) -> None:
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be positive, got {flush_interval_s!r}")
        self.limiter = limiter
        self.flush_interval_s = flush_interval_s
        self.settled = 0
        self.refunded = 0
        self.charged = 0
        # Per tenant: (its config, tokens to settle, requests they come from).
        self._pending: dict[str, tuple[TenantConfig, int, int]] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Requests whose difference is not settled yet."""
        return sum(requests for _, _, requests in self._pending.values())

    def add(self, tenant: TenantConfig, tokens: int) -> None:
        """Charge ``tokens`` more (negative: give back) to ``tenant`` soon."""
        if tokens == 0 or tenant.tokens_per_min is None:
            return
        _, so_far, requests = self._pending.get(tenant.id, (tenant, 0, 0))
        self._pending[tenant.id] = (tenant, so_far + tokens, requests + 1)
        if tokens < 0:
            self.refunded -= tokens
        else:
            self.charged += tokens
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="quota settler")

    async def stop(self) -> None:
        """Stop the background task and settle what is pending (before the limiter closes).

        The task is cancelled only between flushes (the lock held), so no Redis call is
        cut off halfway, which would leave unknown whether it landed."""
        task, self._task = self._task, None
        if task is not None:
            async with self._lock:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush()

    async def flush(self) -> None:
        """Settle every pending difference now, one tenant at a time (differences added
        while one is settled wait for the next round)."""
        async with self._lock:
            while self._pending:
                for tenant_id in list(self._pending):
                    tenant, tokens, requests = self._pending[tenant_id]
                    await self.limiter.settle(tenant, tokens)
                    _, now_tokens, now_requests = self._pending[tenant_id]
                    if now_requests == requests:
                        del self._pending[tenant_id]
                    else:
                        left = (tenant, now_tokens - tokens, now_requests - requests)
                        self._pending[tenant_id] = left
                    self.settled += requests

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a bug must not stop settling for good
                log.exception("quota settlement failed")
            await asyncio.sleep(self.flush_interval_s)
