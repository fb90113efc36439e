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
            agg.busy_slots += entry.busy_slots
            agg.tier_queued_requests += entry.tier_queued_requests
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


def combine_replicas(
    replicas: list[capacity_pb2.CapacitySummary],
) -> capacity_pb2.CapacitySummary:
    """One summary for several replicas of one tier in front of the *same* children.

    The children's counts (GPUs, slots, throughput) are the same in every
    replica's view, so they are taken once (the largest); each replica's own
    busy slots and queue add up; what the GPUs report waiting is counted once.
    """
    if len(replicas) == 1:
        return replicas[0]
    newest = max(replicas, key=lambda r: r.timestamp_ms)
    combined = capacity_pb2.CapacitySummary()
    combined.CopyFrom(newest)
    del combined.models[:]
    by_model: dict[str, list[capacity_pb2.ModelCapacity]] = {}
    for replica in replicas:
        for entry in replica.models:
            by_model.setdefault(entry.model, []).append(entry)
    for model in sorted(by_model):
        entries = by_model[model]
        out = combined.models.add(model=model)
        out.healthy_gpus = max(e.healthy_gpus for e in entries)
        out.total_gpus = max(e.total_gpus for e in entries)
        out.total_slots = max(e.total_slots for e in entries)
        out.token_throughput_capacity = max(e.token_throughput_capacity for e in entries)
        out.unknown_children = max(e.unknown_children for e in entries)
        out.busy_slots = min(out.total_slots, sum(e.busy_slots for e in entries))
        out.free_slots = out.total_slots - out.busy_slots
        out.tier_queued_requests = sum(e.tier_queued_requests for e in entries)
        reported = max(e.queued_requests - e.tier_queued_requests for e in entries)
        out.queued_requests = reported + out.tier_queued_requests
        out.utilisation = out.busy_slots / out.total_slots if out.total_slots else 0.0
        out.kv_cache_usage = max(e.kv_cache_usage for e in entries)
        out.estimated_wait_s = max(e.estimated_wait_s for e in entries)
    combined.publisher_healthy = any(r.publisher_healthy for r in replicas)
    return combined


CAPACITY_HINT = "x-meridian-capacity"
_HINT_FIELDS = (
    ("h", "healthy_gpus"),
    ("t", "total_gpus"),
    ("s", "total_slots"),
    ("f", "free_slots"),
    ("q", "queued_requests"),
    ("u", "unknown_children"),
)


def encode_hint(entry: capacity_pb2.ModelCapacity) -> str:
    """The compact trailer form of one model's capacity: ``h=3,t=4,s=64,f=10,q=0,u=0,w=0.120``."""
    counts = ",".join(f"{key}={getattr(entry, name)}" for key, name in _HINT_FIELDS)
    return f"{counts},w={entry.estimated_wait_s:.3f}"


def decode_hint(value: str | None, model: str) -> capacity_pb2.ModelCapacity | None:
    """Inverse of ``encode_hint``; None when absent or malformed (a hint is only a hint)."""
    if not value:
        return None
    try:
        fields = dict(part.split("=", 1) for part in value.split(","))
        entry = capacity_pb2.ModelCapacity(model=model)
        for key, name in _HINT_FIELDS:
            setattr(entry, name, int(fields[key]))
        entry.estimated_wait_s = float(fields["w"])
    except (KeyError, ValueError):
        return None
    if entry.total_slots:
        entry.utilisation = (entry.total_slots - entry.free_slots) / entry.total_slots
    return entry


UTILISATION_BANDS = (0.5, 0.8, 0.95, 1.0)


def utilisation_band(utilisation: float) -> int:
    """Which band a utilisation falls in; crossing a band is a significant change."""
    return sum(1 for edge in UTILISATION_BANDS if utilisation >= edge)


def significant_change(
    old: capacity_pb2.CapacitySummary, new: capacity_pb2.CapacitySummary
) -> bool:
    """A GPU lost or found, a model appearing or going, or a utilisation band crossed."""
    before = {e.model: e for e in old.models}
    after = {e.model: e for e in new.models}
    if before.keys() != after.keys():
        return True
    for model, entry in after.items():
        prev = before[model]
        if entry.healthy_gpus != prev.healthy_gpus:
            return True
        if utilisation_band(entry.utilisation) != utilisation_band(prev.utilisation):
            return True
    return False


class Backoff:
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
        self.latest: capacity_pb2.CapacitySummary | None = None
        # Each model's entry of ``latest`` in trailer form, encoded once per publish.
        self._hints: dict[str, str] = {}
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
        backoff = Backoff(f"publisher {self.stream}")
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

    def follow(self, streams: Mapping[str, str]) -> None:
        """Follow these streams from now on (a reloaded topology); a new one is read
        from its start within one ``block_ms``."""
        self.streams = dict(streams)

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
        backoff = Backoff("capacity reader")
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
