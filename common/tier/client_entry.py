"""The OpenAI edge of an inner tier: clients call it directly, beside the tier above.

An inner tier's V2 port serves the tier above only: it believes the internal
metadata it is sent (tenant, origin, prefix blocks, attempt:
``TierSpec.trust_internal``) and counts no quota, the edge above having
authenticated the caller and applied its limits. Its OpenAI HTTP port
(``openai_listen`` in the region's or zone's entry) faces clients, so what
enters there takes an entry of its own into the same children, balancer and
forwarding loop (``TierServer`` builds it):

* an ``InferenceProxy`` of its own, on the tier's spec with
  ``trust_internal=False``: internal keys a client sends are dropped, never
  believed, and unknown ``x-meridian-*`` keys refused, as at the global edge; a
  ``x-meridian-client-region`` the fleet does not have is INVALID_ARGUMENT, as
  the global tier's origin resolution says (``KnownRegions``);
* ``ClientGate``: the edge's admission (``edge_admission``: API keys, priority
  ceilings, rate limits and concurrency caps shared with every other edge
  through the tenants' Redis, one usage record per finished request), and data
  residency: a tenant whose ``allowed_regions`` leaves out the region this tier
  serves in is PERMISSION_DENIED (the global edge would never route it here);
* a ``CallInterceptor`` of its own whose observers are the tier's (tracing,
  metrics, shed log) and the gate, so usage is recorded for these calls, once
  each, and never for the V2 calls from the tier above.

Requests from the tier above keep their path: the V2 port, trusted metadata,
no quota, no usage record (the edge above writes it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint
from common.config.openai_edge import OpenAIEdgeConfig
from common.config.redis_layout import RedisKeys, redis_url_for
from common.config.topology import Topology
from common.request.call import CallRecord
from common.request.pick import PickRequest
from common.request.proxy import TierSpec
from common.request.routing import CLIENT_REGION, RouteHints
from common.request.streaming import Release
from common.tenancy.admission import Admission, edge_admission


@dataclass(frozen=True)
class KnownRegions:
    """A tier's origin resolution that first refuses a client region the fleet does
    not have (INVALID_ARGUMENT, worded as the global tier's ``ClientOrigin``)."""

    regions: frozenset[str]
    resolve: Callable[[RouteHints], GeoPoint | None]

    def __call__(self, hints: RouteHints) -> GeoPoint | None:
        region = hints.client_region
        if region is not None and region not in self.regions:
            raise RouteError.invalid(
                f"metadata '{CLIENT_REGION}': unknown region {region!r}; "
                f"known: {', '.join(sorted(self.regions))}"
            )
        return self.resolve(hints)


@dataclass
class ClientGate:
    """Who is calling an inner tier's OpenAI edge and whether its limits let the
    request in: ``admission`` (the edge's), then data residency for ``region``.
    Also the call observer that writes the usage records, and owns the admission's
    Redis clients (``start`` / ``stop``)."""

    admission: Admission
    # The region this tier serves in.
    region: str
    # Every region of the fleet (a client may name one in x-meridian-client-region).
    regions: frozenset[str]

    def identify(self, metadata: object, hints: RouteHints) -> RouteHints:
        hints = self.admission.identify(metadata, hints)
        if hints.allowed_regions and self.region not in hints.allowed_regions:
            raise RouteError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant '{hints.tenant}' may be served only in "
                f"{', '.join(sorted(hints.allowed_regions))}; this endpoint serves "
                f"{self.region!r}: call one of those regions, or the global endpoint",
            )
        return hints

    async def admit(
        self, hints: RouteHints, pick: PickRequest, call: CallRecord | None = None
    ) -> Release:
        return await self.admission.admit(hints, pick, call)

    def call_started(self, call: CallRecord) -> None:
        self.admission.call_started(call)

    def call_ended(self, call: CallRecord) -> None:
        self.admission.call_ended(call)

    async def start(self) -> None:
        await self.admission.start()

    async def stop(self) -> None:
        await self.admission.stop()

    def client_spec(self, spec: TierSpec) -> TierSpec:
        """The tier's ``spec`` as its clients' entry runs it (see the module docstring)."""
        return dataclasses.replace(
            spec,
            trust_internal=False,
            resolve_origin=KnownRegions(self.regions, spec.resolve_origin),
        )


@dataclass(frozen=True)
class OpenAIFront:
    """A tier's OpenAI HTTP (``TierServer.openai``): where it listens, and at an inner
    tier the gate its clients pass (None: the tier is the edge, whose V2 callers are
    clients too: the OpenAI calls take its own proxy and call interceptor)."""

    config: OpenAIEdgeConfig
    gate: ClientGate | None = None


def edge_front(config: OpenAIEdgeConfig | None) -> OpenAIFront | None:
    """The edge tier's OpenAI HTTP, if its entry has ``openai_listen``."""
    return None if config is None else OpenAIFront(config)


def client_front(
    topology: Topology, region: str, *, zone: str | None = None, replicas: int = 1
) -> OpenAIFront | None:
    """The OpenAI HTTP of ``region``'s regional tier, or (``zone``) of that zone's local
    tier, if its entry has ``openai_listen``; ``replicas``: the processes of this edge
    (``--workers``), whose share of each quota is 1/replicas while Redis is down. A
    local tier's routes start at its zone: its usage records are given the region."""
    entry = topology.region(region) if zone is None else topology.zone(region, zone)
    if entry.openai is None:
        return None
    admission = edge_admission(
        topology.auth,
        redis_url_for(topology, RedisKeys.TENANTS),
        replicas,
        topology.usage_replicas_ack,
        route_above=region if zone is not None else "",
    )
    regions = frozenset(r.name for r in topology.regions)
    return OpenAIFront(entry.openai, ClientGate(admission, region, regions))
