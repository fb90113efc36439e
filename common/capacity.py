"""Capacity summaries over Redis streams: publish on a cadence, follow, aggregate.

local tier --XADD--> ``meridian:capacity:zone:<region>:<zone>``
regional   --XREAD-> aggregates its zones --XADD--> ``meridian:capacity:region:<region>``
global     --XREAD-> region summaries

Streams are bounded with ``XADD ... MAXLEN ~``. Readers use plain XREAD, not
consumer groups, because every replica of a tier needs every summary. A
Redis outage only stops fresh summaries: publisher and reader log once,
back off, reconnect and resume on their own; routing never waits on Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.gen.meridian.v1 import capacity_pb2

log = logging.getLogger(__name__)

SUMMARY_FIELD = b"summary"
MAX_BACKOFF_S = 2.0


def zone_stream(region: str, zone: str) -> str:
    return f"meridian:capacity:zone:{region}:{zone}"


def region_stream(region: str) -> str:
    return f"meridian:capacity:region:{region}"


def aggregate(
    parts: Iterable[capacity_pb2.CapacitySummary],
    *,
    unknown: Iterable[str] = (),
    source_id: str,
    sequence: int,
    region: str,
    zone: str = "",
    publisher_healthy: bool = True,
    now_ms: int | None = None,
) -> capacity_pb2.CapacitySummary:
    """Combine child summaries into one: counts add up; ratios are re-derived from
    the sums or weighted by slots, never averaged as averages. ``unknown`` names
    a model once per child that is up but has no fresh summary."""
    totals: dict[str, capacity_pb2.ModelCapacity] = {}
    wait_weight: dict[str, float] = {}
    kv_weight: dict[str, float] = {}
    for part in parts:
        for entry in part.models:
            agg = totals.setdefault(entry.model, capacity_pb2.ModelCapacity(model=entry.model))
            agg.healthy_gpus += entry.healthy_gpus
            agg.total_gpus += entry.total_gpus
            agg.total_slots += entry.total_slots
            agg.free_slots += entry.free_slots
            agg.queued_requests += entry.queued_requests
            agg.token_throughput_capacity += entry.token_throughput_capacity
            agg.unknown_children += entry.unknown_children
            wait_weight[entry.model] = wait_weight.get(entry.model, 0.0) + (
                entry.estimated_wait_s * entry.total_slots
            )
            kv_weight[entry.model] = kv_weight.get(entry.model, 0.0) + (
                entry.kv_cache_usage * entry.total_slots
            )
    for model in unknown:
        totals.setdefault(model, capacity_pb2.ModelCapacity(model=model)).unknown_children += 1
    for model, agg in totals.items():
        if agg.total_slots:
            agg.utilisation = (agg.total_slots - agg.free_slots) / agg.total_slots
            agg.estimated_wait_s = wait_weight[model] / agg.total_slots
            agg.kv_cache_usage = kv_weight[model] / agg.total_slots
    return capacity_pb2.CapacitySummary(
        source_id=source_id,
        sequence=sequence,
        timestamp_ms=now_ms if now_ms is not None else int(time.time() * 1000),
        region=region,
        zone=zone,
        publisher_healthy=publisher_healthy,
        models=[totals[m] for m in sorted(totals)],
    )


class _Backoff:
    """Exponential back-off for reconnecting to Redis, logging each outage once."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.delay = 0.0

    async def failed(self, exc: Exception) -> None:
        if self.delay == 0.0:
            log.warning("%s: redis unavailable (%s); retrying with back-off", self.what, exc)
        self.delay = min(MAX_BACKOFF_S, max(0.1, self.delay * 2))
        await asyncio.sleep(self.delay)

    def succeeded(self) -> None:
        if self.delay:
            log.info("%s: redis is back", self.what)
        self.delay = 0.0


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
        self.redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        self.stream = stream
        self.build = build
        self.cadence_s = cadence_s
        self.maxlen = maxlen
        self.sequence = 0
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"publish {self.stream}")

    def poke(self) -> None:
        """Publish now rather than at the next tick (a significant change happened)."""
        self._poke.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.redis.aclose()

    async def publish_once(self) -> None:
        self.sequence += 1
        summary = self.build(self.sequence)
        await self.redis.xadd(
            self.stream,
            {SUMMARY_FIELD: summary.SerializeToString()},
            maxlen=self.maxlen,
            approximate=True,
        )

    async def _run(self) -> None:
        backoff = _Backoff(f"publisher {self.stream}")
        while True:
            try:
                await self.publish_once()
                backoff.succeeded()
            except (RedisError, OSError) as exc:
                await backoff.failed(exc)
                continue
            self._poke.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self.cadence_s)


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
        self.redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=block_ms / 1000 + 1.0, socket_connect_timeout=1.0
        )
        self.streams = dict(streams)
        self.deliver = deliver
        self.block_ms = block_ms
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="capacity reader")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
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
        backoff = _Backoff("capacity reader")
        last_ids: dict[str, bytes | str] = dict.fromkeys(self.streams, "0-0")
        caught_up = False
        while True:
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
