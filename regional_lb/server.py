"""Regional tier wiring: one region's zones behind a V2 endpoint; reads zone
summaries, publishes the region's."""

from __future__ import annotations

import random
from collections.abc import Callable

from common.basics.geo import GeoPoint
from common.capacity.streams import CapacityPublisher, region_stream, zone_stream
from common.capacity.summary import aggregate
from common.config.identity import regional
from common.config.node import ConfigError
from common.config.redis_layout import RedisKeys
from common.config.tls import tier_tls
from common.config.topology import RegionConfig, Topology
from common.gen.meridian.v1 import capacity_pb2
from common.observability.tracing import Telemetry, setup_tracing
from common.operations.admin import upper_tier_admin
from common.operations.ops_access import OpsAccess
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.resilience import SlowStartConfig
from common.request.routing import RouteHints
from common.tenancy.admission import inner_admission
from common.tier.client_entry import client_front
from common.tier.server import TierServer, source_id
from common.tier.wiring import summary_publisher, summary_reader, tier_children
from regional_lb.picker import ZonePicker


def region_summary(
    zones: ChildSet, *, source: str, sequence: int, region: str
) -> capacity_pb2.CapacitySummary:
    """Aggregate the fresh summaries of the zones that are up by direct evidence;
    a zone that is up but whose summary is missing or stale counts as unknown."""
    now = zones.clock()
    parts: list[capacity_pb2.CapacitySummary] = []
    unknown: list[str] = []
    for zone in zones:
        if not zone.healthy:
            continue
        summary = zone.fresh_summary(now, zones.summary_ttl_s)
        if zone.drained:
            # A drained zone offers no capacity: its GPUs count, none of them as healthy,
            # so the global routes away from a region whose zones are all drained.
            if summary is not None:
                parts.append(drained(summary))
            continue
        if summary is None:
            unknown.extend(zone.models)
        else:
            parts.append(summary)
    return aggregate(
        parts,
        unknown=unknown,
        source_id=source,
        sequence=sequence,
        region=region,
        publisher_healthy=zones.any_healthy(),
    )


def drained(summary: capacity_pb2.CapacitySummary) -> capacity_pb2.CapacitySummary:
    """``summary`` as a drained zone's: the same GPUs, none healthy, no slots."""
    return capacity_pb2.CapacitySummary(
        source_id=summary.source_id,
        sequence=summary.sequence,
        timestamp_ms=summary.timestamp_ms,
        region=summary.region,
        zone=summary.zone,
        publisher_healthy=summary.publisher_healthy,
        models=[
            capacity_pb2.ModelCapacity(model=m.model, total_gpus=m.total_gpus)
            for m in summary.models
        ],
    )


def region_publisher(topology: Topology, zones: ChildSet, region: str) -> CapacityPublisher:
    """Publishes the region's summary (its zones' aggregate) on its stream, in the
    global Redis, as this process incarnation (a source id of its own)."""
    source = source_id("regional", region)
    return summary_publisher(
        topology,
        region_stream(region),
        lambda seq: region_summary(zones, source=source, sequence=seq, region=region),
        RedisKeys.REGION_SUMMARIES,
    )


def zone_children(region_cfg: RegionConfig) -> list[Child]:
    return [
        Child(name=z.name, endpoint=z.address, models=z.models, location=z.location)
        for z in region_cfg.zones
    ]


def zone_picker(
    topology: Topology, region_cfg: RegionConfig, rng: random.Random | None = None
) -> ZonePicker:
    """The regional tier's picker as ``topology`` configures it (the fleet simulator
    builds the same one)."""
    return ZonePicker(
        region_cfg.location,
        topology.summary_ttl_s,
        failback=SlowStartConfig(window_s=topology.failback_window_s),
        rng=rng or random.Random(),
    )


def regional_policy(topology: Topology, region: str) -> ForwardingPolicy:
    """How a regional tier forwards to its zones (the fleet simulator forwards by it too)."""
    return ForwardingPolicy(
        kind="zone", route_prefix=region, per_try=topology.liveness.per_try_timeout
    )


def build_regional_tier(
    topology: Topology, region: str, *, reload_from: Callable[[], Topology] | None = None,
    telemetry: Telemetry | None = None, publish: bool = True, replicas: int = 1,
) -> TierServer:
    """The regional tier of ``region`` as described by ``topology``; ``reload_from``
    re-reads the topology for the Admin API's ReloadTopology. ``publish``: false for all
    but one of ``--workers`` (the same aggregate N times would add up N times above);
    ``replicas``: its processes, sharing its OpenAI edge's quotas (common.tier.client_entry)."""
    region_cfg = topology.region(region)
    tls = tier_tls(topology, regional(region))
    zones = tier_children(topology, zone_children(region_cfg), "zone", tls=tls)
    reader = summary_reader(
        topology,
        {zone_stream(region, z.name): z.name for z in region_cfg.zones},
        zones,
        RedisKeys.ZONE_SUMMARIES,
        region,
    )
    publisher = region_publisher(topology, zones, region) if publish else None
    picker = zone_picker(topology, region_cfg)

    def origin(hints: RouteHints) -> GeoPoint:
        return hints.origin or region_cfg.location

    def wanted(new: Topology) -> list[Child]:
        try:
            return zone_children(new.region(region))
        except ConfigError:  # this region is gone: keep serving what it has
            return list(zones)

    def follow(new: Topology) -> None:
        reader.follow({zone_stream(region, z.name): z.name for z in wanted(new)})

    return TierServer(
        TierSpec(tier="regional", trust_internal=True, resolve_origin=origin),
        regional_policy(topology, region),
        zones,
        RankingBalancer(picker, zones),
        region_cfg.endpoint,
        publisher=publisher,
        reader=reader,
        tls=tls,
        admission=inner_admission(topology.auth),
        limits=topology.limits,
        keepalive=topology.liveness.keepalive,
        ops=region_cfg.ops,
        name=region,
        tenants=topology.auth.tenant_ids,
        ops_access=OpsAccess.of(topology.auth),
        telemetry=telemetry or setup_tracing("meridian-regional"),
        admin=upper_tier_admin(
            "regional", region, "zone", zones, topology, wanted, follow=follow, source=reload_from
        ),
        openai=client_front(topology, region, replicas=replicas),
    )
