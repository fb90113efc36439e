"""Usage records for billing: one per finished request at the edge, in a Redis stream.

edge proxy --record()--> in-memory buffer --EVALSHA, one batch at a time--> ``meridian:usage``
``meridian usage`` --XRANGE in chunks--> totals per (tenant, model)

Each batch is written *exactly once*: one Lua script checks the batch's
marker key (``<stream>:batch:<uuid>``), XADDs the records, counts them in
``<stream>:meta`` and sets the marker, atomically. A batch whose write failed
or timed out is retried whole under the same id, so a write that landed
although its answer was lost is skipped on retry, not doubled. A marker
lives ``dedup_ttl_s`` (6 h); a batch still unwritten after that is written
anyway (a possible double, logged, rather than a loss). ``summarise`` also
counts each ``request_id`` once within a horizon, for writers that retry on
their own. A crash of the edge loses what it still buffered.

Redis acknowledges a write before its replicas have it, so a failover can
lose the last acknowledged batches. With ``replicas_ack`` (topology key
``usage_replicas_ack``) a batch counts as written only once that many
replicas have it (Redis WAIT on the recorder's one connection); until then
it is kept and retried like a failed write, which the marker makes safe.

``<stream>:meta`` (a hash) lets a reader tell a complete stream from one that
lost entries: ``created_ms`` (Redis time of the first write), ``added``
(entries ever written, against XLEN: what ``MAXLEN ~`` trimmed), and
``resets`` / ``last_reset_ms``, set when a recorder that had written before
finds the hash gone (Redis lost its data: restarted without persistence,
flushed, or failed over to an empty replica).

Records are filtered by ``finished_at_ms`` (the edge's clock), not by stream
entry ids (Redis's clock at write time), because a record buffered through an
outage is written long after it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque

from redis.exceptions import RedisError

from common.basics.redis_url import async_redis
from common.capacity.streams import redis_backoff
from common.tenancy.usage_read import UsageTotals, summarise
from common.tenancy.usage_record import (
    OK_STATUS,
    USAGE_STREAM,
    UsageRecord,
    batch_key,
    meta_key,
    new_request_id,
)

# The module people import for usage: the record, its reader and its writer.
__all__ = [
    "OK_STATUS",
    "USAGE_STREAM",
    "UsageRecord",
    "UsageRecorder",
    "UsageTotals",
    "meta_key",
    "new_request_id",
    "summarise",
]

log = logging.getLogger(__name__)


# KEYS: stream, meta hash, batch marker. ARGV: maxlen, marker TTL (s), fields per
# record, 1 if this recorder wrote to the stream before, then the records' fields.
# The marker is set last: a script cut short by an error writes the batch again
# (at least once), never skips part of it. A batch already written refreshes its
# marker instead: replication is ordered, so once a replica has that write it has
# the batch. Returns {records added, 1 if a reset was found}.
_WRITE_BATCH = """
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('EXPIRE', KEYS[3], ARGV[2])  -- a write after the batch's, for WAIT
  return {0, 0}
end
local now = redis.call('TIME')
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
local reset = 0
if redis.call('HSETNX', KEYS[2], 'created_ms', now_ms) == 1 and ARGV[4] == '1' then
  reset = 1
  redis.call('HINCRBY', KEYS[2], 'resets', 1)
  redis.call('HSET', KEYS[2], 'last_reset_ms', now_ms)
end
local width = tonumber(ARGV[3])
local added = 0
for i = 5, #ARGV, width do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, i, i + width - 1))
  added = added + 1
end
redis.call('HINCRBY', KEYS[2], 'added', added)
redis.call('SET', KEYS[3], 1, 'EX', ARGV[2])
return {added, reset}
"""


@dataclasses.dataclass
class _Batch:
    """Records written together under one id, and when they were first tried (monotonic)."""

    batch_id: str
    records: list[UsageRecord]
    first_tried: float


class UsageRecorder:
    """Buffers usage records in memory and writes them to a stream in batches, exactly once.

    ``record()`` is synchronous and O(1): the request path never waits on Redis.
    A background task flushes every ``flush_interval_s`` or as soon as
    ``batch_size`` records wait. While Redis is down, records stay buffered and
    the task backs off and retries. A batch whose write failed (or timed out:
    it may have landed) is kept apart and retried whole under its id before
    anything else, so the script skips it if it landed. The buffer holds at most
    ``buffer_limit`` records besides that one batch; beyond, the *oldest* are
    dropped and counted in ``dropped``. Counters: ``written``, ``dropped``,
    ``pending``, ``resets_seen`` (times the stream's metadata had vanished).
    """

    def __init__(
        self,
        redis_url: str,
        *,
        stream: str = USAGE_STREAM,
        maxlen: int = 1_000_000,
        buffer_limit: int = 100_000,
        batch_size: int = 500,
        flush_interval_s: float = 0.1,
        socket_timeout_s: float = 1.0,
        dedup_ttl_s: int = 6 * 3600,
        replicas_ack: int = 0,
        replicas_timeout_s: float = 1.0,
    ) -> None:
        if min(buffer_limit, batch_size, maxlen, dedup_ttl_s) < 1 or socket_timeout_s <= 0:
            raise ValueError("buffer_limit, batch_size, maxlen, dedup_ttl_s, timeout: positive")
        if replicas_ack < 0 or replicas_timeout_s <= 0:
            raise ValueError("replicas_ack must be >= 0 and replicas_timeout_s positive")
        # One connection: WAIT counts the replicas that have this connection's writes.
        self.redis = async_redis(
            redis_url,
            socket_timeout=socket_timeout_s + (replicas_timeout_s if replicas_ack else 0.0),
            socket_connect_timeout=1.0,
            single_connection_client=True,
        )
        self._script = self.redis.register_script(_WRITE_BATCH)
        self.stream = stream
        self.maxlen = maxlen
        self.buffer_limit = buffer_limit
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.dedup_ttl_s = dedup_ttl_s
        self.replicas_ack = replicas_ack
        self.replicas_timeout_s = replicas_timeout_s
        self.written = 0
        self.dropped = 0
        self.resets_seen = 0
        self._buffer: deque[UsageRecord] = deque()
        self._retry: _Batch | None = None  # the batch whose write may or may not have landed
        self._overflowing = False
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def pending(self) -> int:
        """Records buffered and not yet known to be written."""
        return len(self._buffer) + (len(self._retry.records) if self._retry else 0)

    def record(self, rec: UsageRecord) -> None:
        """Queue one record (never blocks); an empty ``request_id`` gets a fresh uuid4 hex."""
        if not rec.request_id:
            rec = dataclasses.replace(rec, request_id=new_request_id())
        if len(self._buffer) >= self.buffer_limit:
            self._buffer.popleft()
            self._count_dropped(1)
        self._buffer.append(rec)
        if len(self._buffer) >= self.batch_size:
            self._wake.set()

    def _count_dropped(self, n: int) -> None:
        self.dropped += n
        if not self._overflowing:
            self._overflowing = True
            log.warning(
                "usage buffer full (%d records, redis %s unwritable): dropping the oldest",
                self.buffer_limit,
                self.stream,
            )

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"usage recorder {self.stream}")

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the background task, flush what can be written within ``timeout_s``, close."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            log.error(
                "usage recorder stopped with %d records unwritten (%s: %s)",
                self.pending,
                type(exc).__name__,
                exc,
            )
        await self.redis.aclose()

    async def flush(self) -> None:
        """Write everything buffered now; raises ``RedisError``/``OSError`` (records kept)."""
        async with self._lock:
            while self._retry is not None or self._buffer:
                if self._retry is None:
                    take = min(self.batch_size, len(self._buffer))
                    records = [self._buffer.popleft() for _ in range(take)]
                    # Kept here until known written: a failure, a timeout or a
                    # cancellation leaves it to be retried under the same id.
                    self._retry = _Batch(new_request_id(), records, time.monotonic())
                await self._write(self._retry)
                self.written += len(self._retry.records)
                self._retry = None
            if self._overflowing:
                self._overflowing = False
                log.warning("usage buffer drained; %d records dropped so far", self.dropped)

    async def _write(self, batch: _Batch) -> None:
        if time.monotonic() - batch.first_tried > self.dedup_ttl_s:
            log.warning(
                "usage batch %s first tried over %d s ago: its marker may be gone, so if "
                "that try landed its %d records are now in %s twice",
                batch.batch_id, self.dedup_ttl_s, len(batch.records), self.stream,
            )  # fmt: skip
        fields = [rec.to_fields() for rec in batch.records]
        width = 2 * len(fields[0])
        flat = [item for f in fields for pair in f.items() for item in pair]
        keys = [self.stream, meta_key(self.stream), batch_key(self.stream, batch.batch_id)]
        wrote_before = "1" if self.written else "0"
        args: list[str | int] = [self.maxlen, self.dedup_ttl_s, width, wrote_before, *flat]
        _, reset = await self._script(keys=keys, args=args)
        if self.replicas_ack:
            timeout_ms = int(self.replicas_timeout_s * 1000)
            acked = await self.redis.wait(self.replicas_ack, timeout_ms)
            if acked < self.replicas_ack:  # kept, and retried like a failed write
                raise RedisError(
                    f"usage batch on {acked} of the {self.replicas_ack} replicas it must reach "
                    f"within {self.replicas_timeout_s:g} s (usage_replicas_ack)"
                )
        if reset:
            self.resets_seen += 1
            log.error(
                "usage stream %s lost its data since this recorder last wrote to it (Redis "
                "restarted without persistence, was flushed, or failed over to an empty "
                "replica): records written before are gone; marked in %s",
                self.stream, meta_key(self.stream),
            )  # fmt: skip

    async def _run(self) -> None:
        backoff = redis_backoff(f"usage recorder {self.stream}")
        # Not ``while True``: a cancellation can be lost on its way in (Python 3.11's
        # wait_for and Redis clients swallow one that races a result), so stop() also
        # says so here, and the loop ends within one flush interval whatever happened.
        while not self._stopping:
            if len(self._buffer) < self.batch_size:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.flush_interval_s):
                        await self._wake.wait()
            try:
                await self.flush()
                backoff.succeeded()
            except (RedisError, OSError) as exc:
                await backoff.failed(exc)
