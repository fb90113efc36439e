"""The Admin API (``meridian.v1.Admin``), served by every tier beside V2.

One mechanism for all three tiers: a tier applies an action whose target is
one of its own children and forwards any other to the child whose subtree
holds the target (the topology says which; names are unique in it), over
the channel it already has to that child. Operators therefore call only the
global endpoint; inner tiers accept only the tier above (mutual TLS), and
the global wants an admin key whenever ``auth.admin_keys`` holds any
(``AdminGuard``). ``ListTopology`` fans out the same way and merges;
``ReloadTopology`` reloads this tier, then forwards to every child, so the
whole tree reloads. ``upper_tier_admin`` wires it for the global and
regional tiers (``local_lb.admin`` for the local tier).

What a tier does to its own children is in its ``TierHooks``: how it
describes a child, whether weights apply (GPUs only) and how it reloads.
Drain state and weights live in the tier process: a restarted tier starts
with nothing drained and every weight 1. So a tier run as several workers on
one port (``--workers``, ``cli.workers``) refuses the changes it would apply
itself (drain, undrain, weight, reload) with FAILED_PRECONDITION: one call
reaches one worker. Listing, and forwarding to the tier below, still work.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from common.basics.errors import RouteError
from common.config.node import ConfigError
from common.config.topology import Topology
from common.gen.meridian.v1 import admin_pb2 as apb
from common.gen.meridian.v1 import admin_pb2_grpc as apb_grpc
from common.operations.reload import reload_children, unapplied_settings
from common.request.children import Child, ChildSet
from common.tenancy.auth import AdminGuard

log = logging.getLogger(__name__)

ADMIN_SERVICE = apb.DESCRIPTOR.services_by_name["Admin"].full_name
# The tier below each tier, for naming a child tier in reports.
TIER_BELOW = {"global": "regional", "regional": "local"}
# How long a forwarded admin call may take when the caller set no deadline.
FORWARD_TIMEOUT_S = 10.0
# A call forwarded to a child tier gets this share of the caller's remaining time,
# so a slow child shows as an error entry in the answer instead of running the
# whole call into DEADLINE_EXCEEDED; ListTopology waits at most LIST_TIMEOUT_S too.
BELOW_SHARE = 0.8
LIST_TIMEOUT_S = 3.0


def subtree_index(topology: Topology, tier: str, name: str) -> dict[str, tuple[str, str]]:
    """Every region, zone and GPU below this tier: name -> (own child holding it, kind)."""
    index: dict[str, tuple[str, str]] = {}
    for region in topology.regions:
        if tier == "global":
            index[region.name] = (region.name, "region")
        elif tier == "regional" and region.name != name:
            continue
        for zone in region.zones:
            if tier == "local" and zone.name != name:
                continue
            owner = {"global": region.name, "regional": zone.name}.get(tier)
            if owner is not None:
                index[zone.name] = (owner, "zone")
            for gpu in zone.gpus:
                index[gpu.name] = (owner or gpu.name, "gpu")
    return index


@dataclass
class TierHooks:
    """What one tier does to its own children."""

    describe: Callable[[Child], apb.Node]
    reload: Callable[[Topology], Awaitable[apb.TierReload]]
    # None: weights do not apply to this tier's children (only GPUs have them).
    set_weight: Callable[[Child, float], None] | None = None


def describe_child(child: Child, kind: str, now: float, ttl_s: float) -> apb.Node:
    """A region or zone as the tier above sees it: health, drain, in flight, and its
    newest fresh summary (for several models, the model with the most slots)."""
    node = apb.Node(
        name=child.name,
        kind=kind,
        endpoint=child.endpoint.address,
        healthy=child.healthy,
        drained=child.drained,
        outstanding_requests=max(0, child.outstanding_requests),
        last_error=child.last_error,
    )
    summary = child.fresh_summary(now, ttl_s)
    if summary is not None and summary.models:
        entry = max(summary.models, key=lambda m: (m.total_slots, m.total_gpus))
        node.summary_fresh = True
        node.healthy_gpus = entry.healthy_gpus
        node.total_gpus = entry.total_gpus
        node.total_slots = entry.total_slots
        node.free_slots = entry.free_slots
        node.queued_requests = entry.queued_requests
        node.utilisation = entry.utilisation
    return node


class AdminService(apb_grpc.AdminServicer):
    """The Admin servicer of one tier (see the module docstring)."""

    def __init__(
        self,
        tier: str,
        name: str,
        children: ChildSet,
        topology: Topology,
        hooks: TierHooks,
        *,
        source: Callable[[], Topology] | None = None,
        guard: AdminGuard | None = None,
    ) -> None:
        self.tier = tier
        self.name = name
        self.label = tier if tier == "global" else f"{tier} {name}"
        self.children = children
        self.topology = topology
        self.hooks = hooks
        # Re-reads the file this tier was started from; None: ReloadTopology is refused.
        self.source = source
        self.guard = guard
        self.index = subtree_index(topology, tier, name)
        self._reloading = asyncio.Lock()
        # Processes serving this tier's port (``--workers``): above 1, ``_one_worker``.
        self.workers = 1

    def register(self, server: grpc.aio.Server) -> None:
        apb_grpc.add_AdminServicer_to_server(self, server)

    # ------------------------------------------------------------------ plumbing

    async def _fail(self, context: grpc.aio.ServicerContext, err: RouteError) -> None:
        await context.abort(err.code, err.message)

    def _authorise(self, context: grpc.aio.ServicerContext) -> None:
        if self.guard is not None:
            self.guard.check(context.invocation_metadata())

    def _locate(self, target: str) -> tuple[Child, str]:
        """This tier's child whose subtree holds ``target``, and the target's kind."""
        where = self.index.get(target)
        child = self.children.by_name.get(where[0]) if where else None
        if where is None or child is None:
            raise RouteError(
                grpc.StatusCode.NOT_FOUND,
                f"no region, zone or GPU named {target!r} behind the {self.label} tier",
            )
        return child, where[1]

    def _one_worker(self) -> None:
        if self.workers > 1:
            raise RouteError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the {self.label} tier runs as {self.workers} workers on one port "
                f"(--workers {self.workers}): this change would reach only the worker the "
                "call landed on; change the topology file and restart the tier, or run one "
                "worker",
            )

    def _stub(self, child: Child) -> apb_grpc.AdminStub:
        if child.channel is None:
            raise RouteError.unavailable(f"{self.children.kind} {child.name} has no channel yet")
        return apb_grpc.AdminStub(child.channel)

    @staticmethod
    def _timeout(context: grpc.aio.ServicerContext | None) -> float:
        remaining = context.time_remaining() if context is not None else None
        return FORWARD_TIMEOUT_S if remaining is None else max(0.1, float(remaining))

    async def _forward(
        self,
        method: str,
        request: Any,
        child: Child,
        context: grpc.aio.ServicerContext,
        timeout: float | None = None,
    ) -> Any:
        """Call ``method`` on the tier below ``child``; its error becomes ours."""
        try:
            return await getattr(self._stub(child), method)(
                request, timeout=timeout or self._timeout(context)
            )
        except grpc.aio.AioRpcError as exc:
            raise RouteError(exc.code(), exc.details() or exc.code().name) from None

    # ------------------------------------------------------------------ RPCs

    async def ListTopology(
        self, request: apb.ListTopologyRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListTopologyResponse:
        try:
            self._authorise(context)
        except RouteError as err:
            await self._fail(context, err)
        children = list(self.children)
        nodes = [self.hooks.describe(c) for c in children]
        if self.tier in TIER_BELOW:
            below = await asyncio.gather(
                *(self._list_below(c, context) for c in children), return_exceptions=True
            )
            for node, result in zip(nodes, below, strict=True):
                if isinstance(result, apb.ListTopologyResponse):
                    node.children.extend(result.nodes)
                else:
                    node.error = str(result)
        return apb.ListTopologyResponse(nodes=nodes)

    async def _list_below(
        self, child: Child, context: grpc.aio.ServicerContext
    ) -> apb.ListTopologyResponse:
        try:
            timeout = min(LIST_TIMEOUT_S, BELOW_SHARE * self._timeout(context))
            reply: apb.ListTopologyResponse = await self._forward(
                "ListTopology", apb.ListTopologyRequest(), child, context, timeout
            )
        except RouteError as err:
            raise RuntimeError(f"{err.code.name}: {err.message}") from None
        return reply

    async def Drain(
        self, request: apb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> apb.AdminActionResponse:
        return await self._drain(request, context, drained=True)

    async def Undrain(
        self, request: apb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> apb.AdminActionResponse:
        return await self._drain(request, context, drained=False)

    async def _drain(
        self, request: apb.DrainRequest, context: grpc.aio.ServicerContext, *, drained: bool
    ) -> apb.AdminActionResponse:
        try:
            self._authorise(context)
            child, kind = self._locate(request.target)
            if child.name != request.target:
                method = "Drain" if drained else "Undrain"
                reply: apb.AdminActionResponse = await self._forward(
                    method, request, child, context
                )
                return reply
            self._one_worker()
            if not self.children.set_drained(child, drained):
                raise RouteError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.children.kind} {child.name} is being removed (a reloaded topology "
                    "dropped it): it stays drained until its last requests end",
                )
        except RouteError as err:
            await self._fail(context, err)
            raise  # unreachable: abort raises
        detail = (
            "no new requests; requests in flight finish" if drained else "takes new requests again"
        )
        return apb.AdminActionResponse(
            target=child.name, kind=kind, applied_by=self.label, detail=detail
        )

    async def SetWeight(
        self, request: apb.SetWeightRequest, context: grpc.aio.ServicerContext
    ) -> apb.AdminActionResponse:
        try:
            self._authorise(context)
            if not (math.isfinite(request.weight) and request.weight > 0):
                raise RouteError.invalid(f"weight must be a number > 0, got {request.weight}")
            child, kind = self._locate(request.gpu)
            if kind != "gpu":
                raise RouteError.invalid(f"{request.gpu!r} is a {kind}; weights apply to GPUs only")
            if child.name != request.gpu:
                reply: apb.AdminActionResponse = await self._forward(
                    "SetWeight", request, child, context
                )
                return reply
            if self.hooks.set_weight is None:
                raise RouteError.invalid(f"the {self.label} tier has no GPU weights")
            self._one_worker()
            self.hooks.set_weight(child, request.weight)
        except RouteError as err:
            await self._fail(context, err)
            raise  # unreachable: abort raises
        return apb.AdminActionResponse(
            target=child.name,
            kind=kind,
            applied_by=self.label,
            detail=f"weight {request.weight:g}",
        )

    async def ReloadTopology(
        self, request: apb.ReloadTopologyRequest, context: grpc.aio.ServicerContext
    ) -> apb.ReloadTopologyResponse:
        try:
            self._authorise(context)
            async with self._reloading:
                own = await self._reload_self()
        except RouteError as err:
            await self._fail(context, err)
            raise  # unreachable: abort raises
        # Forward to the children of the new topology (new ones included: they were
        # started from the new file, reloading is a no-op for them).
        below = [c for c in self.children if c.name in self.index]
        replies = await asyncio.gather(*(self._reload_below(c, context) for c in below))
        tiers = [own]
        for reply in replies:
            tiers.extend(reply)
        return apb.ReloadTopologyResponse(tiers=tiers)

    async def _reload_self(self) -> apb.TierReload:
        self._one_worker()
        if self.source is None:
            raise RouteError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the {self.label} tier was not started from a topology file",
            )
        try:
            topology = self.source()
        except (ConfigError, OSError) as exc:
            refused = {"event": "reload_refused", "tier": self.label, "error": str(exc)}
            log.warning("topology not reloaded: %s", exc, extra=refused)
            raise RouteError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"topology not reloaded, nothing changed: {exc}",
            ) from None
        try:
            report = await self.hooks.reload(topology)
        except RouteError:
            raise
        except Exception as exc:  # a bug: say so (not UNKNOWN), and what it may have left
            log.exception("the %s tier failed applying a reloaded topology", self.label)
            raise RouteError(
                grpc.StatusCode.INTERNAL,
                f"the {self.label} tier failed applying the reloaded topology "
                f"({type(exc).__name__}: {exc}); part of it may be applied, its children "
                "were not reloaded: see 'meridian admin list' and the tier's log",
            ) from None
        report.tier = self.label
        report.not_applied.extend(unapplied_settings(self.topology, topology, self.tier, self.name))
        self.topology = topology
        self.index = subtree_index(topology, self.tier, self.name)
        if self.guard is not None:
            report.not_applied.extend(self.guard.take_admin_keys(topology.auth))
        changes = {k: list(getattr(report, k)) for k in ("added", "removed", "changed")}
        fields: dict[str, object] = {"event": "reload", "tier": self.label, **changes}
        log.info("topology reloaded", extra={**fields, "not_applied": list(report.not_applied)})
        return report

    async def _reload_below(
        self, child: Child, context: grpc.aio.ServicerContext
    ) -> Sequence[apb.TierReload]:
        if self.tier not in TIER_BELOW:
            return ()
        try:
            timeout = BELOW_SHARE * self._timeout(context)
            reply: apb.ReloadTopologyResponse = await self._forward(
                "ReloadTopology", apb.ReloadTopologyRequest(), child, context, timeout
            )
        except RouteError as err:
            label = f"{TIER_BELOW[self.tier]} {child.name}"
            return (apb.TierReload(tier=label, error=f"{err.code.name}: {err.message}"),)
        return reply.tiers


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
