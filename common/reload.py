"""Applying a reloaded topology to a tier's children (Admin ReloadTopology).

The tier builds the children the new topology wants; ``reload_children``
diffs them against the running ones by name. A new child gets a channel and
a health watch (it starts as down, so it is routed to only once it answered,
and then ramps up like any child that came back). A removed child is
drained at once and closed once its in-flight calls have ended. A kept
child takes over changed models and location; an address change is not
applied (a child is its address: add it under a new name instead).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from common.admin import AdminGuard, AdminService, TierHooks, describe_child
from common.children import Child, ChildSet
from common.config import Topology
from common.gen.meridian.v1 import admin_pb2 as apb


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
    return report


def upper_tier_admin(
    tier: str,
    name: str,
    kind: str,
    children: ChildSet,
    topology: Topology,
    wanted: Callable[[Topology], Sequence[Child]],
    *,
    follow: Callable[[Topology], None] = lambda t: None,
    source: Callable[[], Topology] | None = None,
    guard: AdminGuard | None = None,
) -> AdminService:
    """The Admin API of a global or regional tier, whose children are plain ``Child``s
    built from the topology by ``wanted``; ``follow`` applies the tier's other
    reloadable settings (summary streams to read, the RTT matrix)."""

    def describe(child: Child) -> apb.Node:
        return describe_child(child, kind, children.clock(), children.summary_ttl_s)

    async def reload(new: Topology) -> apb.TierReload:
        report = await reload_children(children, wanted(new))
        follow(new)
        return report

    return AdminService(
        tier, name, children, topology, TierHooks(describe, reload), source=source, guard=guard
    )
