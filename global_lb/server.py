"""Global tier wiring: the client-facing V2 endpoint over all regions; reads region summaries."""

from __future__ import annotations

import random
from collections.abc import Callable

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint
from common.capacity.streams import region_stream
from common.config.identity import GLOBAL
from common.config.redis_layout import RedisKeys, redis_url_for
from common.config.tls import tier_tls
from common.config.topology import Topology
from common.observability.tracing import Telemetry, setup_tracing
from common.operations.admin import upper_tier_admin
from common.operations.fleet_view import FleetView
from common.operations.ops_http import OpsAccess, OpsAdditions
from common.request.balancer import RankingBalancer
from common.request.children import Child
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.resilience import SlowStartConfig
from common.request.routing import CLIENT_REGION, RouteHints
from common.tenancy.admission import edge_admission
from common.tenancy.auth import AdminGuard
from common.tier.client_entry import edge_front
from common.tier.server import TierServer
from common.tier.wiring import summary_reader, tier_children
from global_lb.picker import RegionPicker


def region_children(topology: Topology) -> list[Child]:
    return [
        Child(name=r.name, endpoint=r.address, models=r.models, location=r.location)
        for r in topology.regions
    ]


class ClientOrigin:
    """Where a request comes from: the client's geo, else its declared region's
    location, else the global tier's own (INVALID_ARGUMENT for an unknown region)."""

    def __init__(self, topology: Topology) -> None:
        self.home = topology.global_tier.location
        self.locations: dict[str, GeoPoint] = {}
        self.follow(topology)

    def follow(self, topology: Topology) -> None:
        self.locations.update({r.name: r.location for r in topology.regions})

    def __call__(self, hints: RouteHints) -> GeoPoint:
        region = hints.client_region
        if region is not None and region not in self.locations:
            raise RouteError.invalid(
                f"metadata '{CLIENT_REGION}': unknown region {region!r}; "
                f"known: {', '.join(sorted(self.locations))}"
            )
        if hints.origin is not None:
            return hints.origin
        if region is not None:
            return self.locations[region]
        return self.home


def region_picker(topology: Topology, rng: random.Random | None = None) -> RegionPicker:
    """The global tier's picker as ``topology`` configures it (the fleet simulator
    builds the same one)."""
    return RegionPicker(
        topology.global_tier.location,
        topology.summary_ttl_s,
        rtt_ms=topology.rtt_ms,
        failback=SlowStartConfig(window_s=topology.failback_window_s),
        rng=rng or random.Random(),
    )


def global_policy(topology: Topology) -> ForwardingPolicy:
    """How the global tier forwards to regions (the fleet simulator forwards by it too)."""
    return ForwardingPolicy(kind="region", per_try=topology.liveness.per_try_timeout)


def build_global_tier(
    topology: Topology, *, reload_from: Callable[[], Topology] | None = None,
    telemetry: Telemetry | None = None, replicas: int = 1,
) -> TierServer:
    """The global tier as described by ``topology``; ``reload_from`` re-reads the topology
    for the Admin API's ReloadTopology; ``telemetry`` replaces the OTel environment's;
    ``replicas``: its processes (``--workers``), times ``global.replicas`` sharing quotas."""
    tls = tier_tls(topology, GLOBAL)  # its own certificate, presented to the regions
    regions = tier_children(topology, region_children(topology), "region", tls=tls)
    streams = {region_stream(r.name): r.name for r in topology.regions}
    reader = summary_reader(topology, streams, regions, RedisKeys.REGION_SUMMARIES)
    picker = region_picker(topology)
    # The global's ops HTTP also answers for the whole fleet and serves the dashboard.
    fleet_view = FleetView(topology) if topology.global_tier.ops is not None else None
    origin = ClientOrigin(topology)

    def follow(new: Topology) -> None:
        reader.follow({region_stream(r.name): r.name for r in new.regions})
        picker.follow_rtt(new.rtt_ms)
        origin.follow(new)
        if fleet_view is not None:  # the dashboard shows the fleet the new file names
            fleet_view.follow(new)

    tenants_redis = redis_url_for(topology, RedisKeys.TENANTS)  # quotas, leases, usage
    return TierServer(
        TierSpec(tier="global", trust_internal=False, resolve_origin=origin),
        global_policy(topology),
        regions,
        RankingBalancer(picker, regions),
        topology.global_tier.endpoint,
        reader=reader,
        tls=tls,
        admission=edge_admission(
            topology.auth, tenants_redis, replicas * topology.global_tier.replicas,
            topology.usage_replicas_ack,
        ),
        limits=topology.limits,
        keepalive=topology.liveness.keepalive,
        ops=topology.global_tier.ops,
        ops_additions=OpsAdditions(extensions=(fleet_view,) if fleet_view else ()),
        name="global",
        tenants=topology.auth.tenant_ids,
        ops_access=OpsAccess.of(topology.auth),
        telemetry=telemetry or setup_tracing("meridian-global"),
        admin=upper_tier_admin(
            "global",
            "global",
            "region",
            regions,
            topology,
            region_children,
            follow=follow,
            source=reload_from,
            guard=AdminGuard(topology.auth),
        ),
        openai=edge_front(topology.global_tier.openai),  # beside V2, into the same proxy
    )
