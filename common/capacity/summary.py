"""Capacity summaries as data: pure arithmetic over ``CapacitySummary`` messages.

Aggregating zones into a region, combining a tier's replicas, the compact trailer
hint a tier returns with each answer, and what counts as a significant change.
No I/O here: the Redis streams that carry summaries are ``common.capacity.streams``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from common.gen.meridian.v1 import capacity_pb2


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

    A zone's replicas (local tiers, ``--workers``) each count the GPUs' slots whole
    and their own requests busy: the children's counts (GPUs, slots, throughput)
    are taken once (the largest); each replica's busy slots and queue add up; what
    the GPUs report waiting is counted once. A region's replicas each aggregate the
    same zones' summaries, whose busy slots already count every request: adding them
    would count each request once per replica, so the newest is the region's.
    """
    if len(replicas) == 1:
        return replicas[0]
    newest = max(replicas, key=lambda r: r.timestamp_ms)
    if not any(r.zone for r in replicas):
        return newest
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


def expected_wait_s(
    entry: capacity_pb2.ModelCapacity,
    sent_since: int,
    sent_work: float,
    in_flight_work: float = 0.0,
) -> float:
    """A child's reported wait, grown by what its parent sent it after the report:
    ``sent_work`` (``PickRequest.work`` summed over the ``sent_since`` requests, net of
    those back since) drained at the child's capacity is what its backlog grew by. So
    between reports a child that keeps receiving looks busier and the next one gets its
    turn, an idle one included (the fleet simulator's finding: a growth proportional to
    the reported wait left a zone reported idle at zero however much was sent, and every
    request of the next half second herded to it: 0 requests a zone for seconds, then
    500 in 100 ms). The work sent is what those requests carry, whoever asks: a
    child is as busy for a long request as for a short one (grown by the asker's size,
    long requests alone fled busy children, all to the same quiet one).

    Never less than the parent's own ``in_flight_work`` there drained the same way: a
    report is as old as the summaries under it, and what was sent while it was being
    made is in neither the report nor the count since; the parent's own load is exact,
    whenever the report was made. A report without a capacity (an older peer's hint)
    grows in proportion to its busy slots."""
    capacity = entry.token_throughput_capacity
    if capacity > 0:
        grown = entry.estimated_wait_s + sent_work / capacity
        return max(grown, in_flight_work / capacity, 0.0)
    busy = max(1, entry.total_slots - entry.free_slots)
    return entry.estimated_wait_s * max(0, busy + sent_since) / busy


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
    """The compact trailer form of one model's capacity:
    ``h=3,t=4,s=64,f=10,q=0,u=0,w=0.120000,c=8000``. The wait is to the microsecond: zones
    of a region are a fraction of a millisecond apart, and a wait rounded to the
    millisecond outweighed that distance (0.78 ms read as 1 ms)."""
    counts = ",".join(f"{key}={getattr(entry, name)}" for key, name in _HINT_FIELDS)
    return f"{counts},w={entry.estimated_wait_s:.6f},c={entry.token_throughput_capacity:.0f}"


def repeats_hint(summary: capacity_pb2.CapacitySummary, hint: capacity_pb2.ModelCapacity) -> bool:
    """Whether ``summary`` is the publication ``hint`` came from, as far as a hint can
    tell (its entry for the hint's model reads back as the same hint)."""
    for entry in summary.models:
        if entry.model == hint.model:
            return decode_hint(encode_hint(entry), hint.model) == hint
    return False


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
        # Absent from an older peer's hint: 0, and expected_wait_s grows it by slots.
        entry.token_throughput_capacity = float(fields.get("c", 0.0))
    except (KeyError, ValueError):
        return None
    if not (entry.estimated_wait_s >= 0 and entry.token_throughput_capacity >= 0):
        return None  # NaN or negative: it would rank the child anywhere
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
