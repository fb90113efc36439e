"""Capacity summaries over Redis streams: publish on a cadence, follow, aggregate.

local tier --XADD--> ``meridian:capacity:zone:{<region>}:<zone>``   (the region's Redis)
regional   --XREAD-> aggregates its zones --XADD--> ``meridian:capacity:region:{regions}:<region>``
global     --XREAD-> region summaries                                 (the global Redis)

The ``{…}`` are Redis Cluster hash tags: a reader follows all its streams in one
XREAD, which a cluster serves only when they share a slot (a regional tier's
zone streams: the region's name; the global tier's region streams: ``regions``).
Which Redis each lives on is decided in ``common.config.redis_layout``.

Streams are bounded with ``XADD ... MAXLEN ~``. Readers use plain XREAD, not
consumer groups, because every replica of a tier needs every summary. A
Redis outage only stops fresh summaries: publisher and reader log once,
back off, reconnect and resume on their own; routing never waits on Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from redis.exceptions import RedisError

from common.basics.backoff import Reconnect
from common.basics.redis_url import async_redis
from common.basics.tasks import cancel_and_wait
from common.capacity.summary import encode_hint
from common.gen.meridian.v1 import capacity_pb2

log = logging.getLogger(__name__)

SUMMARY_FIELD = b"summary"
# Reconnecting to Redis: 0.1 s doubling to this.
MAX_BACKOFF_S = 2.0


def zone_stream(region: str, zone: str) -> str:
    return f"meridian:capacity:zone:{{{region}}}:{zone}"


def region_stream(region: str) -> str:
    return f"meridian:capacity:region:{{regions}}:{region}"


def redis_backoff(what: str) -> Reconnect:
    """The back-off of a loop reconnecting to Redis (``what`` names it in the log)."""
    return Reconnect(what, service="redis", base_s=0.1, max_s=MAX_BACKOFF_S, logger=log)


class CapacityPublisher:
    """Publishes ``build()`` to a stream every ``cadence_s`` (and at once on ``poke()``)."""

    def __init__(
        self,
        redis_url: str,
        stream: str,
        build: Callable[[int], capacity_pb2.CapacitySummary],
        *,
        cadence_s: float,
        maxlen: int,
    ) -> None:
        self.redis = async_redis(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.stream = stream
        self.build = build
        self.cadence_s = cadence_s
        self.maxlen = maxlen
        self.sequence = 0
        self.latest: capacity_pb2.CapacitySummary | None = None
        # Each model's entry of ``latest`` in trailer form, encoded once per publish.
        self._hints: dict[str, str] = {}
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._backoff = redis_backoff(f"publisher {self.stream}")

    def redis_up(self) -> bool:
        """False from a failed Redis call until one succeeds again (for metrics)."""
        return not self._backoff.backoff.failing

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"publish {self.stream}")

    def poke(self) -> None:
        """Publish now rather than at the next tick (a significant change happened)."""
        self._poke.set()

    async def stop(self) -> None:
        if self._task is not None:
            # Cancelled again until it ends: a cancellation landing inside the Redis
            # client's call can be swallowed there, and one cancel() then hung stop().
            await cancel_and_wait([self._task])
        await self.redis.aclose()

    def latest_hint(self, model: str) -> str | None:
        """This publisher's newest view of ``model`` as a response hint (``encode_hint``)."""
        return self._hints.get(model)

    async def publish_once(self) -> None:
        self.sequence += 1
        summary = self.build(self.sequence)
        self.latest = summary
        self._hints = {entry.model: encode_hint(entry) for entry in summary.models}
        await self.redis.xadd(
            self.stream,
            {SUMMARY_FIELD: summary.SerializeToString()},
            maxlen=self.maxlen,
            approximate=True,
        )

    async def _run(self) -> None:
        backoff = self._backoff
        while True:
            # Cleared before the build, not after the XADD: a poke that lands while
            # this publication is on its way (a zone going idle again just after it
            # filled) publishes once more at once. Cleared after, it was lost, and for
            # a whole cadence the zone read as busy with requests long finished, so
            # its region sent its traffic to the next zone.
            self._poke.clear()
            try:
                await self.publish_once()
                backoff.succeeded()
            except (RedisError, OSError) as exc:
                await backoff.failed(exc)
                continue
            # Not wait_for: on 3.11 it returns the poke when a cancellation lands in the
            # same loop iteration, and the loop went on past its stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cadence_s):
                    await self._poke.wait()


class CapacityReader:
    """Follows summary streams with XREAD and hands each summary to ``deliver``.

    ``streams`` maps a stream name to the child it describes. It starts from
    the newest entry of each stream, so a restarted tier has a view at once.
    """

    def __init__(
        self,
        redis_url: str,
        streams: Mapping[str, str],
        deliver: Callable[[str, capacity_pb2.CapacitySummary], None],
        *,
        block_ms: int = 1000,
    ) -> None:
        self.redis = async_redis(
            redis_url, socket_timeout=block_ms / 1000 + 1.0, socket_connect_timeout=1.0
        )
        self.streams = dict(streams)
        self.deliver = deliver
        self.block_ms = block_ms
        self._task: asyncio.Task[None] | None = None
        self._backoff = redis_backoff("capacity reader")

    def redis_up(self) -> bool:
        """False from a failed Redis call until one succeeds again (for metrics)."""
        return not self._backoff.backoff.failing

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="capacity reader")

    def follow(self, streams: Mapping[str, str]) -> None:
        """Follow these streams from now on (a reloaded topology); a new one is read
        from its start within one ``block_ms``."""
        self.streams = dict(streams)

    async def stop(self) -> None:
        if self._task is not None:
            # As the publisher's: a cancellation swallowed inside a blocking XREAD left
            # the reader looping and its tier's stop() waiting for it for good.
            await cancel_and_wait([self._task])
        await self.redis.aclose()

    def _take(self, stream: bytes | str, fields: Mapping[bytes, bytes]) -> None:
        name = stream.decode() if isinstance(stream, bytes) else stream
        raw = fields.get(SUMMARY_FIELD)
        if raw is None or name not in self.streams:
            return
        summary = capacity_pb2.CapacitySummary()
        try:
            summary.ParseFromString(raw)
        except Exception:  # a corrupt entry must not stop the reader
            log.warning("unreadable summary in %s", name)
            return
        self.deliver(self.streams[name], summary)

    async def _catch_up(self, last_ids: dict[str, bytes | str]) -> None:
        for stream in self.streams:
            newest: Any = await self.redis.xrevrange(stream, count=1)
            if newest:
                entry_id, fields = newest[0]
                last_ids[stream] = entry_id
                self._take(stream, fields)

    async def _run(self) -> None:
        backoff = self._backoff
        last_ids: dict[str, bytes | str] = dict.fromkeys(self.streams, "0-0")
        caught_up = False
        while True:
            for stream in self.streams.keys() - last_ids.keys():
                last_ids[stream] = "0-0"
            for stream in last_ids.keys() - self.streams.keys():
                del last_ids[stream]
            try:
                if not caught_up:
                    await self._catch_up(last_ids)
                    caught_up = True
                replies: Any = await self.redis.xread(
                    last_ids,  # type: ignore[arg-type]
                    block=self.block_ms,
                )
                backoff.succeeded()
            except (RedisError, OSError) as exc:
                caught_up = False  # Redis may have restarted empty: re-read the newest
                await backoff.failed(exc)
                continue
            for stream, entries in replies or ():
                name = stream.decode() if isinstance(stream, bytes) else stream
                for entry_id, fields in entries:
                    last_ids[name] = entry_id
                    self._take(name, fields)
