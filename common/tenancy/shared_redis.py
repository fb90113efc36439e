"""The Redis a quota counts in, and whether it can be used right now.

``QuotaRedis`` runs the quotas' Lua scripts (rate limits in
``common.tenancy.quota``, concurrency leases in ``common.tenancy.concurrency``;
at the edge one client serves both, so one script admits a request to both)
and owns the one decision they share: when Redis counts as down, so that the
quotas fall back to counting in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from common.basics.backoff import Backoff
from common.basics.redis_url import async_redis
from common.tenancy.script_batch import Script, ScriptBatch

log = logging.getLogger(__name__)

Clock = Callable[[], float]

# Re-try Redis after an outage no sooner than this, doubling up to the max.
RETRY_MIN_S = 0.5
RETRY_MAX_S = 5.0
# A call's connect + EVALSHA (+ EVAL after a Redis restart), bounded as a whole.
CALL_TIMEOUTS = 3


class RedisDown(Exception):
    """Redis did not answer a quota's call: count in process instead."""


def _broken_connection(exc: BaseException) -> bool:
    """The connection failed (reset, closed by the server, refused), not a slow answer:
    a new connection may well succeed. Builtin TimeoutError is an OSError, not this."""
    return isinstance(exc, (RedisConnectionError, ConnectionError))


def raise_lost_cancel() -> None:
    """Raise the cancellation of this task if a call swallowed it.

    Python 3.11's ``asyncio.wait_for``, which redis-py uses, returns the result
    and drops a cancellation that arrived as the result did (gh-86296): a
    cancelled request would go on as if nothing happened."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class QuotaRedis:
    """A quota's Redis client: bounded calls, one retry on a new connection, back-off.

    Every call gets ``timeout_s`` to connect and to answer (redis-py's own retries
    off) and ``CALL_TIMEOUTS × timeout_s`` as a whole. A call whose connection
    broke (``ConnectionError``: reset, closed by the server, refused) is sent once
    more after every idle pooled connection is dropped, so it goes out on a new
    one: after a Redis restart or a ``CLIENT KILL`` every pooled connection is
    broken, and without this each would fail one call and flip the quota to its
    fallback. A timeout is not retried (a new connection would wait as long).

    Only when that retry fails too, or the call timed out, is Redis *down*:
    ``degraded`` is set, ``outages`` counts it, one warning is logged, and
    ``due()`` lets one call through to probe Redis after a back-off (0.5 s
    doubling to 5 s) while the others stay in process. The first call that
    succeeds again logs one info and clears ``degraded``. ``reconnects`` counts
    calls that needed the new connection (a restart the quota may want to know of).

    Calls made while the event loop runs one turn share one pipeline
    (``common.tenancy.script_batch``): a connection failure or a timeout is then
    every one of those calls', and each handles it as above.
    """

    def __init__(
        self,
        url: str,
        *,
        what: str,
        fallback: str,
        timeout_s: float = 0.05,
        clock: Clock = time.time,
    ) -> None:
        # The log lines: which quota, and what it does while Redis is down.
        self.what = what
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.clock = clock
        self.client = async_redis(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        # Scripts asked for in one loop turn share a round trip (common.tenancy.script_batch).
        self.batch = ScriptBatch(self.client)
        self.degraded = False
        self.outages = 0
        self.reconnects = 0
        self._backoff = Backoff(RETRY_MIN_S, RETRY_MAX_S)
        self._backoff_s = 0.0
        self._retry_at = 0.0

    async def close(self) -> None:
        await self.batch.drain()
        await self.client.aclose()

    async def warm(self, scripts: Sequence[Script], budget_s: float = 1.0) -> bool:
        """Open a pooled connection and load ``scripts`` before a request needs them.

        Cold, a replica's first quota call pays a connect, EVALSHA's NOSCRIPT and the
        EVAL, all within that one call's budget: on a busy machine the first call is the
        one most likely to time out and send the replica to its fallback share. One
        pipeline, each read still bounded by the client's socket timeout, the whole by
        ``budget_s``. Best effort: when Redis is not there yet, False, and the first call
        finds out as any other (nothing is marked down here)."""
        try:
            async with asyncio.timeout(budget_s):
                pipe = self.client.pipeline(transaction=False)
                for script in scripts:
                    pipe.script_load(script.text)
                await pipe.execute()
        except (RedisError, OSError) as exc:  # TimeoutError is an OSError
            log.info(
                "%s: redis not reachable at start (%s: %s); its first request will try again",
                self.what,
                type(exc).__name__,
                exc,
                extra={"event": "redis_not_warmed", "what": self.what},
            )
            return False
        return True

    def due(self) -> bool:
        """Whether this call should try Redis: always while it is up; while it is
        down, one call per back-off period (the probe), the others stay in process."""
        if not self.degraded:
            return True
        now = self.clock()
        if now < self._retry_at:
            return False
        self._retry_at = now + self._backoff_s
        return True

    async def run(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str],
        *,
        reconnected: Callable[[], Awaitable[None]] | None = None,
    ) -> list[int]:
        """The script's reply; ``RedisDown`` (state updated, logged) when Redis failed.
        ``reconnected`` runs before the retry on a new connection (Redis may have
        restarted empty: a caller may have state to put back first)."""
        try:
            try:
                reply = await self._run_once(script, keys, args)
            except (RedisError, OSError) as exc:
                if not _broken_connection(exc):
                    raise
                self.reconnects += 1
                with contextlib.suppress(RedisError, OSError):  # broken ones may fail to close
                    await self.client.connection_pool.disconnect(inuse_connections=False)
                if reconnected is not None:
                    await reconnected()
                reply = await self._run_once(script, keys, args)
        except (RedisError, OSError) as exc:
            self._failed(exc)
            raise RedisDown(f"{exc.__class__.__name__}: {exc}") from exc
        self._ok()
        return reply

    async def _run_once(
        self, script: Script, keys: Sequence[str], args: Sequence[str]
    ) -> list[int]:
        async with asyncio.timeout(CALL_TIMEOUTS * self.timeout_s):
            return cast(list[int], await self.batch.run(script, keys, args))

    def _failed(self, exc: BaseException) -> None:
        if not self.degraded:
            self.degraded = True
            self.outages += 1
            self._backoff.reset()
            self._backoff_s = self._backoff.next_s()
            log.warning(
                "%s: redis unavailable (%s); %s, re-trying redis with back-off",
                self.what,
                exc.__class__.__name__,
                self.fallback,
                extra={
                    "event": "redis_lost",
                    "what": self.what,
                    "error": f"{type(exc).__name__}: {exc}",
                },
            )
        else:
            self._backoff_s = self._backoff.next_s()
        self._retry_at = self.clock() + self._backoff_s

    def _ok(self) -> None:
        if self.degraded:
            fields = {"event": "redis_back", "what": self.what}
            log.info("%s: redis is back; counting in redis again", self.what, extra=fields)
            self.degraded = False
            self._backoff.reset()
            self._backoff_s = 0.0


def shared_or_own(
    redis: str | QuotaRedis, *, what: str, fallback: str, timeout_s: float, clock: Clock
) -> QuotaRedis:
    """``redis`` itself when it is a ``QuotaRedis`` (the edge's, shared by its quotas),
    else a client of its own for that URL, logging as ``what`` with ``fallback``."""
    if isinstance(redis, QuotaRedis):
        return redis
    return QuotaRedis(redis, what=what, fallback=fallback, timeout_s=timeout_s, clock=clock)
