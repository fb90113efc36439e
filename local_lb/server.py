"""Local tier wiring: one zone's GPUs behind a V2 endpoint, publishing the zone's capacity."""

from __future__ import annotations

import time

from common.capacity import CapacityPublisher, zone_stream
from common.children import Child, ChildSet
from common.config import Topology
from common.gen.meridian.v1 import capacity_pb2
from common.proxy import TierSpec
from common.routing import RouteHints
from common.tier import TierServer, source_id
from local_lb.picker import LeastWorkPicker

# Aggregate decode throughput of one A100 at full batch, tokens/s (emulated GPU's scale).
A100_TOKENS_PER_S = 2000.0


def zone_summary(
    gpus: ChildSet, slots: dict[str, int], *, source: str, sequence: int, region: str, zone: str
) -> capacity_pb2.CapacitySummary:
    """The zone's capacity per model, from this tier's view of its GPUs."""
    models: dict[str, capacity_pb2.ModelCapacity] = {}
    busy: dict[str, int] = {}
    queued_work: dict[str, float] = {}
    for gpu in gpus:
        for model in sorted(gpu.models):
            entry = models.setdefault(model, capacity_pb2.ModelCapacity(model=model))
            entry.total_gpus += 1
            if not gpu.healthy:
                continue
            entry.healthy_gpus += 1
            entry.total_slots += slots[gpu.name]
            running = min(gpu.outstanding_requests, slots[gpu.name])
            busy[model] = busy.get(model, 0) + running
            entry.queued_requests += gpu.outstanding_requests - running
            entry.token_throughput_capacity += gpu.speed * A100_TOKENS_PER_S
            queued_work[model] = queued_work.get(model, 0.0) + gpu.outstanding_work
    for model, entry in models.items():
        entry.free_slots = entry.total_slots - busy.get(model, 0)
        if entry.total_slots:
            entry.utilisation = busy.get(model, 0) / entry.total_slots
            entry.kv_cache_usage = entry.utilisation
        if entry.token_throughput_capacity and entry.queued_requests:
            entry.estimated_wait_s = queued_work[model] / entry.token_throughput_capacity
    return capacity_pb2.CapacitySummary(
        source_id=source,
        sequence=sequence,
        timestamp_ms=int(time.time() * 1000),
        region=region,
        zone=zone,
        publisher_healthy=gpus.any_healthy(),
        models=[models[m] for m in sorted(models)],
    )


def build_local_tier(topology: Topology, region: str, zone: str) -> TierServer:
    """The local tier of ``region``/``zone`` as described by ``topology``."""
    zone_cfg = topology.zone(region, zone)
    gpus = ChildSet(
        (
            Child(name=g.name, endpoint=g.endpoint, models=frozenset(g.models), speed=g.speed)
            for g in zone_cfg.gpus
        ),
        probe_interval_s=topology.health_interval_s,
        summary_ttl_s=topology.summary_ttl_s,
    )
    slots = {g.name: g.max_concurrency for g in zone_cfg.gpus}
    source = source_id("local", region, zone)
    publisher = CapacityPublisher(
        topology.redis_url,
        zone_stream(region, zone),
        lambda seq: zone_summary(
            gpus, slots, source=source, sequence=seq, region=region, zone=zone
        ),
        cadence_s=topology.summary_cadence_s,
        maxlen=topology.summary_stream_maxlen,
    )

    def origin(hints: RouteHints) -> None:
        return None  # the local tier's choice does not depend on geography

    spec = TierSpec(
        tier="local",
        route_prefix=zone,
        trust_internal=True,
        picker=LeastWorkPicker(),
        resolve_origin=origin,
    )
    return TierServer(spec, gpus, zone_cfg.endpoint, publisher=publisher)
