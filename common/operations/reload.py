"""Applying a reloaded topology to a tier's children (Admin ReloadTopology).

The tier builds the children the new topology wants; ``reload_children``
diffs them against the running ones by name. A new child gets a channel and
a health watch (it starts as down, so it is routed to only once it answered,
and then ramps up like any child that came back). A removed child is
drained at once and closed once its in-flight calls have ended. A kept
child takes over changed models and location; an address change is not
applied (a child is its address: add it under a new name instead).
``unapplied_settings`` names what else a running tier leaves alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from common.config.topology import GlobalConfig, RegionConfig, Topology, ZoneConfig
from common.gen.meridian.v1 import admin_pb2 as apb
from common.request.children import Child, ChildSet


async def reload_children(
    children: ChildSet,
    wanted: Sequence[Child],
    *,
    on_added: Callable[[Child], None] = lambda c: None,
    on_gone: Callable[[Child], Awaitable[None]] | None = None,
) -> apb.TierReload:
    """Add, retire and update ``children`` to match ``wanted``; say what changed."""
    report = apb.TierReload()
    wanted_by_name = {c.name: c for c in wanted}
    for name, child in list(children.by_name.items()):
        if name not in wanted_by_name:
            children.retire(child, on_gone)
            report.removed.append(name)
    for child in wanted:
        current = children.by_name.get(child.name)
        if current is not None and children.leaving(child.name):
            report.not_applied.append(
                f"{child.name}: still finishing the requests it had when it was removed; "
                "reload again once it is gone"
            )
            continue
        if current is None:
            child.healthy = False  # until its first health answer
            child.last_error = "new: waiting for its first health check"
            await children.add(child)
            on_added(child)
            report.added.append(child.name)
            continue
        if current.endpoint != child.endpoint:
            report.not_applied.append(
                f"{child.name}: address {current.endpoint} -> {child.endpoint} "
                "(add it under a new name instead)"
            )
        changes = []
        if current.models != child.models:
            changes.append(f"models {sorted(current.models)} -> {sorted(child.models)}")
            current.models = child.models
        if current.location != child.location:
            changes.append("location")
            current.location = child.location
        if current.speed != child.speed:
            changes.append(f"speed {current.speed:g} -> {child.speed:g}")
            current.speed = child.speed
        if changes:
            report.changed.append(f"{child.name}: {', '.join(changes)}")
    if report.changed:
        children.settings_changed()
    return report


# Top-level settings a running tier does not take over (it applies regions, rtt_ms
# and auth.admin_keys); tenant_headroom is read by the local tiers at start.
_RESTART_SETTINGS = (
    "redis_url",
    "summary_cadence_s",
    "summary_stream_maxlen",
    "health_interval_s",
    "time_scale",
    "slow_start_window_s",
    "failback_window_s",
    "tenant_headroom",
    "tls",
    "limits",
    "usage_replicas_ack",
)


def own_config(
    topology: Topology, tier: str, name: str
) -> GlobalConfig | RegionConfig | ZoneConfig | None:
    """This tier's own entry in ``topology`` (None: not in it)."""
    if tier == "global":
        return topology.global_tier
    for region in topology.regions:
        if tier == "regional" and region.name == name:
            return region
        for zone in region.zones:
            if tier == "local" and zone.name == name:
                return zone
    return None


def _own_region(topology: Topology, tier: str, name: str) -> RegionConfig | None:
    """The region a regional tier serves or a local tier's zone is in (None: other tiers)."""
    for region in topology.regions:
        if tier == "regional" and region.name == name:
            return region
        if tier == "local" and any(zone.name == name for zone in region.zones):
            return region
    return None


def unapplied_settings(old: Topology, new: Topology, tier: str, name: str) -> list[str]:
    """Differences a running tier leaves alone: restart it to apply them."""
    out = [
        f"{key} (restart to apply)"
        for key in _RESTART_SETTINGS
        if getattr(old, key) != getattr(new, key)
    ]
    if old.auth.enabled != new.auth.enabled or old.auth.tenants != new.auth.tenants:
        out.append("auth.enabled / auth.tenants (restart to apply)")
    before_region, after_region = _own_region(old, tier, name), _own_region(new, tier, name)
    if before_region and after_region and before_region.redis_url != after_region.redis_url:
        out.append(f"regions[{after_region.name}].redis_url (restart to apply)")
    before, after = own_config(old, tier, name), own_config(new, tier, name)
    if after is None:
        out.append(f"{name} itself is gone from the topology: stop this process")
        return out
    if before is None:
        return out
    if before.endpoint != after.endpoint:
        out.append(f"own listen address {before.endpoint} -> {after.endpoint} (restart to apply)")
    if before.ops != after.ops:
        out.append(f"own ops_listen {before.ops} -> {after.ops} (restart to apply)")
    # The global and a regional tier measure distance from their own location; a
    # local tier's choice does not depend on it (the regional tier's does, and applies it).
    if tier != "local" and before.location != after.location:
        out.append("own location (restart to apply)")
    if tier == "global" and old.global_tier.replicas != new.global_tier.replicas:
        out.append("global.replicas (restart to apply)")
    return out
