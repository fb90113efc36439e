"""Global tier wiring: the client-facing V2 endpoint over all regions; reads region summaries."""

from __future__ import annotations

from collections.abc import Callable

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint
from common.capacity.streams import CapacityReader, region_stream
from common.config.tls import tier_channel_credentials, tier_server_credentials
from common.config.topology import Topology
from common.observability.tracing import setup_tracing
from common.operations.admin import upper_tier_admin
from common.operations.fleet_view import install_fleet_view
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.proxy import TierSpec
from common.request.resilience import SlowStartConfig
from common.request.routing import CLIENT_REGION, RouteHints
from common.tenancy.admission import edge_admission
from common.tenancy.auth import AdminGuard
from common.tier.server import TierServer
from global_lb.picker import RegionPicker


def region_children(topology: Topology) -> list[Child]:
    return [
        Child(name=r.name, endpoint=r.endpoint, models=r.models, location=r.location)
        for r in topology.regions
    ]


def build_global_tier(
    topology: Topology, *, reload_from: Callable[[], Topology] | None = None
) -> TierServer:
    """The global tier as described by ``topology``; ``reload_from`` re-reads the topology
    for the Admin API's ReloadTopology."""
    regions = ChildSet(
        region_children(topology),
        probe_interval_s=topology.health_interval_s,
        summary_ttl_s=topology.summary_ttl_s,
        kind="region",
        credentials=tier_channel_credentials(topology.tls),
    )
    reader = CapacityReader(
        topology.redis_url,
        {region_stream(r.name): r.name for r in topology.regions},
        regions.take_summary,
    )
    locations = {r.name: r.location for r in topology.regions}
    home = topology.global_tier.location

    def origin(hints: RouteHints) -> GeoPoint:
        """Client geo, else its declared region's location, else the global's own."""
        if hints.client_region is not None and hints.client_region not in locations:
            raise RouteError.invalid(
                f"metadata '{CLIENT_REGION}': unknown region {hints.client_region!r}; "
                f"known: {', '.join(sorted(locations))}"
            )
        if hints.origin is not None:
            return hints.origin
        if hints.client_region is not None:
            return locations[hints.client_region]
        return home

    spec = TierSpec(
        tier="global",
        route_prefix=None,
        trust_internal=False,
        resolve_origin=origin,
    )
    picker = RegionPicker(
        home,
        topology.summary_ttl_s,
        rtt_ms=topology.rtt_ms,
        failback=SlowStartConfig(window_s=topology.failback_window_s),
    )
    balancer = RankingBalancer(picker, regions)

    def follow(new: Topology) -> None:
        reader.follow({region_stream(r.name): r.name for r in new.regions})
        picker.rtt_ms = new.rtt_ms
        locations.update({r.name: r.location for r in new.regions})
        if fleet_view is not None:  # the dashboard shows the fleet the new file names
            fleet_view.follow(new)

    admin = upper_tier_admin(
        "global",
        "global",
        "region",
        regions,
        topology,
        region_children,
        follow=follow,
        source=reload_from,
        guard=AdminGuard(topology.auth),
    )
    tier = TierServer(
        spec,
        regions,
        balancer,
        topology.global_tier.endpoint,
        reader=reader,
        credentials=tier_server_credentials(topology.tls, edge=True),
        admission=edge_admission(topology.auth, topology.redis_url),
        limits=topology.limits,
        ops=topology.global_tier.ops,
        name="global",
        tenants=topology.auth.tenant_ids,
        telemetry=setup_tracing("meridian-global"),
        admin=admin,
    )
    # The global's ops HTTP also answers for the whole fleet and serves the dashboard.
    fleet_view = install_fleet_view(topology, tier.ops_server)
    return tier
