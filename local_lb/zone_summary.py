"""The zone's capacity summary: what the local tier publishes on its zone's stream,
summed from its view of the GPUs and its central queue."""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.capacity.streams import CapacityPublisher, zone_stream
from common.config.redis_layout import RedisKeys
from common.config.topology import Topology
from common.gen.meridian.v1 import capacity_pb2
from common.tier.server import source_id
from common.tier.wiring import summary_publisher
from local_lb.cost import capacity_work_per_s, drain_rps
from local_lb.queue import CentralQueue
from local_lb.state import LocalView


def zone_publisher(
    topology: Topology, view: LocalView, queue: CentralQueue, region: str, zone: str
) -> CapacityPublisher:
    """Publishes the zone's summary on its stream, in its region's Redis, as this process
    incarnation (a source id of its own)."""
    source = source_id("local", region, zone)
    return summary_publisher(
        topology,
        zone_stream(region, zone),
        lambda seq: zone_summary(
            view, queue, source=source, sequence=seq, region=region, zone=zone
        ),
        RedisKeys.ZONE_SUMMARIES,
        region,
    )


def zone_summary(
    view: LocalView,
    queue: CentralQueue,
    *,
    source: str,
    sequence: int,
    region: str,
    zone: str,
    now: float | None = None,
) -> capacity_pb2.CapacitySummary:
    """The zone's capacity per model, from this tier's view of its GPUs; ``now`` is the
    view's clock (default: the monotonic clock the servers use).

    Runs on every publication (the cadence and each poke: ~0.25 per request on a busy
    fleet) over every GPU, so the sums are kept in plain numbers per model and written
    to the message once, and a zone whose GPUs all serve the same models (the usual
    one) is summed in one pass without per-model bookkeeping. ``estimated_wait_s`` is
    the queue's wait plus the work in flight over the zone's hardware throughput. A GPU's
    slots count whole, only this process's requests busy (``GpuChild.whole_slots``)."""
    now = time.monotonic() if now is None else now
    gpus = view.gpus
    models = gpus[0].models if gpus else frozenset()
    if len(models) == 1 and all(g.models == models for g in gpus):
        sums = {model: _sums_of_one(view, now) for model in models}
    else:
        sums = _sums_per_model(view, now)
    return capacity_pb2.CapacitySummary(
        source_id=source,
        sequence=sequence,
        timestamp_ms=int(time.time() * 1000),
        region=region,
        zone=zone,
        publisher_healthy=any(g.healthy for g in view.gpus),
        models=[_model_capacity(m, sums[m], view, queue) for m in sorted(sums)],
    )


def _sums_of_one(view: LocalView, now: float) -> _ModelSums:
    """``_sums_per_model`` for a zone whose GPUs all serve one model: the same sums,
    in the same order, in locals, with ``GpuChild.usable``, ``LoadBook.get``'s age rule
    and ``drain_rps`` (when the model's GPUs are the zone's, as the view indexed them)
    written out, this being the summary's whole cost."""
    samples, max_age = view.load.newest, view.report_max_age_s
    healthy = slots_total = busy = queued = 0
    throughput = kv = backlog = 0.0
    drain: float = 0  # as sum() starts
    for gpu in view.gpus:
        if not gpu.healthy or gpu.ejected or gpu.drained:
            continue
        healthy += 1
        slots, whole = gpu.slots, gpu.gpu_slots or gpu.slots  # GpuChild.whole_slots
        slots_total += whole
        inflight = gpu.outstanding_requests
        busy += inflight if inflight <= slots else slots
        throughput += capacity_work_per_s(gpu)
        backlog += gpu.outstanding_work
        drain += slots / (gpu.latency_ewma_s or 1.0)
        sample = samples.get(gpu.name)
        if sample is not None and not now - sample.taken_at > max_age:
            queued += int(sample.waiting)
            if sample.kv_cache_usage is not None:
                kv += sample.kv_cache_usage * whole
    sums = _ModelSums(len(view.gpus), healthy, slots_total, busy, throughput, queued, kv, backlog)
    (model,) = view.gpus[0].models
    if view.by_model.get(model) == view.gpus:
        sums.drain = drain
    return sums


def _sums_per_model(view: LocalView, now: float) -> dict[str, _ModelSums]:
    sums: dict[str, _ModelSums] = {}
    load, max_age = view.load, view.report_max_age_s
    for gpu in view.gpus:
        usable = gpu.usable
        sample = load.get(gpu.name, now, max_age) if usable else None
        for model in gpu.models:
            acc = sums.get(model)
            if acc is None:
                acc = sums[model] = _ModelSums()
            acc.total_gpus += 1
            if not usable:
                continue
            acc.healthy_gpus += 1
            acc.total_slots += gpu.whole_slots
            acc.busy += min(gpu.outstanding_requests, gpu.slots)
            acc.throughput += capacity_work_per_s(gpu)
            acc.backlog += gpu.outstanding_work
            if sample is not None:
                acc.queued += int(sample.waiting)
                if sample.kv_cache_usage is not None:
                    acc.kv += sample.kv_cache_usage * gpu.whole_slots
    return sums


@dataclass(slots=True)
class _ModelSums:
    """One model's running totals over a zone's GPUs (``zone_summary``)."""

    total_gpus: int = 0
    healthy_gpus: int = 0
    total_slots: int = 0
    busy: int = 0
    throughput: float = 0.0
    queued: int = 0
    kv: float = 0.0
    backlog: float = 0.0
    # drain_rps of the model's GPUs when summed with the rest (else computed apart).
    drain: float | None = None


def _model_capacity(
    model: str, acc: _ModelSums, view: LocalView, queue: CentralQueue
) -> capacity_pb2.ModelCapacity:
    tier_queued = queue.depth_for_model(model)
    queued = acc.queued + tier_queued
    entry = capacity_pb2.ModelCapacity(
        model=model,
        healthy_gpus=acc.healthy_gpus,
        total_gpus=acc.total_gpus,
        total_slots=acc.total_slots,
        free_slots=acc.total_slots - acc.busy,
        queued_requests=queued,
        token_throughput_capacity=acc.throughput,
        busy_slots=acc.busy,
        tier_queued_requests=tier_queued,
    )
    if acc.total_slots:
        entry.utilisation = acc.busy / acc.total_slots
        entry.kv_cache_usage = acc.kv / acc.total_slots
    drain = acc.drain if acc.drain is not None else drain_rps(view.by_model.get(model, ()))
    if queued and drain:
        entry.estimated_wait_s = queued / drain
    if acc.throughput:
        # The work in flight, drained at the zone's capacity (local_lb.cost), so under
        # continuous batching a busier zone is a slower one before a request must queue.
        entry.estimated_wait_s += acc.backlog / acc.throughput
    return entry
