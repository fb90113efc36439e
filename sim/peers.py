"""Upper-tier peers: how fleets pick a region or a zone without Meridian's pickers.

Each is a ``Picker`` over ``common.request.children.Child`` (regions at the
global tier, zones at a regional tier), pure and synchronous like
``RegionPicker`` and ``ZonePicker``, so the simulator runs them through the
same ``RankingBalancer``. All of them rank only children that may serve the
request — up by direct evidence, not drained, serving the model, and not
known from a fresh summary to have no healthy GPU (``Child.may_serve``) — and,
where the children are regions, only regions the tenant may be served in
(``PickRequest.allowed_regions``, data residency: a legal constraint every
peer keeps). The ranking is the chosen child first, then the failover order.

Two region pickers stand for the two ways peers are fronted across regions:
``NearestRegionPicker`` is geo-DNS (nearest region that is up, no spill on
load) and ``SpillRegionPicker`` a cloud global load balancer that spills a
region's overflow to the next-nearest one once the region is at its capacity.

Each costs O(children) per pick (a handful of regions or zones), with no
allocation beyond the ranking itself.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.basics.geo import GeoPoint, rtt_estimate_ms
from common.request.children import Child
from common.request.pick import PickRequest

# Cached RTTs (origin, client region, child) before the cache is dropped and refilled.
RTT_CACHE_LIMIT = 100_000

# A spill picker's default threshold: the share of a region's reported concurrency slots
# its own in-flight requests may fill before the region counts as full (GCP's default
# target utilisation for a backend's balancing mode).
SPILL_THRESHOLD = 0.8


def may_route(
    child: Child, request: PickRequest, now: float, ttl_s: float, residency: bool
) -> bool:
    """``child`` may take ``request``: it may serve the model and, when the children are
    regions (``residency``), the tenant may be served there."""
    if residency and request.allowed_regions and child.name not in request.allowed_regions:
        return False
    return child.may_serve(request.model, now, ttl_s)


@dataclass
class NearestRegionPicker:
    """Geo-DNS with health checks: the nearest region that is up, nothing else.

    The region with the least RTT from the request's origin — the measured
    ``rtt_ms`` matrix (client region -> region -> ms) when it has the pair, else
    the great-circle estimate (``rtt_estimate_ms``) — among the regions that may
    serve it; the others follow by RTT, which is the failover order. No spill on
    load: a region that is up keeps all of its clients however queued it is,
    which is the failure mode this peer stands for. RTTs are cached per
    (origin, client region, region): requests come from a few cities.
    """

    home: GeoPoint
    summary_ttl_s: float
    rtt_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    _rtt: dict[tuple[GeoPoint | None, str | None, str], float] = field(default_factory=dict)

    def rtt(self, request: PickRequest, region: Child) -> float:
        key = (request.origin, request.client_region, region.name)
        known = self._rtt.get(key)
        if known is not None:
            return known
        row = self.rtt_ms.get(request.client_region or "")
        if row is not None and region.name in row:
            value = float(row[region.name])
        else:
            value = rtt_estimate_ms(request.origin or self.home, region.location or self.home)
        if len(self._rtt) >= RTT_CACHE_LIMIT:
            self._rtt.clear()
        self._rtt[key] = value
        return value

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        ttl = self.summary_ttl_s
        ranked = [c for c in children if may_route(c, request, now, ttl, True)]
        ranked.sort(key=lambda c: self.rtt(request, c))
        return ranked


@dataclass
class RoundRobinChildPicker:
    """Round robin: a rotating index over the children; the next one clockwise that may
    take the request wins and the index moves past it; the rest follow clockwise.
    Blind to distance and load. ``residency``: the children are regions."""

    summary_ttl_s: float
    residency: bool = False
    _next: int = 0

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        n = len(children)
        start = self._next % n if n else 0
        ranked: list[Child] = []
        for i in range(n):
            child = children[(start + i) % n]
            if may_route(child, request, now, self.summary_ttl_s, self.residency):
                if not ranked:
                    self._next = (start + i + 1) % n
                ranked.append(child)
        return ranked


@dataclass
class RandomChildPicker:
    """Uniformly random order over the children that may take the request.
    ``residency``: the children are regions."""

    rng: random.Random
    summary_ttl_s: float
    residency: bool = False

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        ttl = self.summary_ttl_s
        ranked = [c for c in children if may_route(c, request, now, ttl, self.residency)]
        self.rng.shuffle(ranked)
        return ranked


def slot_load(child: Child, model: str, now: float, ttl_s: float) -> float:
    """This tier's outstanding requests on ``child`` per concurrency slot it has: total
    slots from its fresh report, 1 when unknown (so an unknown child looks full early)."""
    entry = child.model_capacity(model, now, ttl_s)
    slots = entry.total_slots if entry is not None and entry.total_slots > 0 else 1
    return child.outstanding_requests / slots


@dataclass
class LeastLoadedChildPicker:
    """Least connections per slot: the child with the fewest outstanding requests from
    this tier per concurrency slot (``slot_load``), ties at random, the rest by load.

    ``p2c``: power of two choices instead — two children drawn at random, the
    less loaded first, then the other, then the rest by load. Both read only
    this tier's own counts and the slot totals (which change only when GPUs come
    or go), never queue lengths or waits. ``residency``: the children are regions.
    """

    rng: random.Random
    summary_ttl_s: float
    residency: bool = False
    p2c: bool = False

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        ttl = self.summary_ttl_s
        model = request.model
        rng = self.rng
        scored = [
            (slot_load(c, model, now, ttl), rng.random(), c)
            for c in children
            if may_route(c, request, now, ttl, self.residency)
        ]
        if self.p2c and len(scored) > 2:
            two = rng.sample(scored, 2)
            rest = sorted(
                (s for s in scored if s is not two[0] and s is not two[1]),
                key=lambda s: (s[0], s[1]),
            )
            low, high = (two[0], two[1]) if two[0][0] <= two[1][0] else (two[1], two[0])
            return [low[2], high[2], *(s[2] for s in rest)]
        scored.sort(key=lambda s: (s[0], s[1]))
        return [s[2] for s in scored]


def spill_utilisation(child: Child, model: str, now: float, ttl_s: float) -> float:
    """A global balancer's utilisation of ``child``: its own in-flight requests to it per
    concurrency slot the child reports (``slot_load``; an in-flight balancing mode).

    Unknown capacity (no fresh report, or no slots in it) reads as one slot, so a
    region routed on health alone counts as full once one request is in flight.
    Never the child's queues or the requests' lengths: a balancer does not see them.
    """
    return slot_load(child, model, now, ttl_s)


@dataclass
class SpillRegionPicker:
    """A cloud global load balancer: waterfall by region, spilling on capacity.

    The nearest region (RTT as ``NearestRegionPicker`` measures it) takes the
    request while its utilisation (``spill_utilisation``: this balancer's
    in-flight requests per slot the region reports) is under ``threshold``;
    past it the next-nearest region under the threshold does, and so on — as
    GCP's global external Application LB fills the nearest region up to its
    balancing mode's capacity before the overflow goes on. The ranking is every
    region under the threshold by RTT, then the regions at or over it least
    utilised first (RTT breaks ties): when every region is full the balancer
    spreads the overflow towards equal utilisation, as a capacity-scaled one
    does, rather than piling it on the nearest. Only regions that may serve the
    request and that the tenant may be served in are ranked.

    ``threshold`` is the operator's setting (default ``SPILL_THRESHOLD``). The
    slots a region reports are its engines' largest batches, past the load at
    which answers stay quick, so a lower threshold spills earlier, queues less
    and pays more RTT: the reports should say which threshold they ran.

    Failure mode: the threshold is a fixed share of slots, blind to request
    cost; a region full of long answers and one of short ones look alike, and
    a region whose report is stale is all but skipped until it reports again.
    Caches RTTs only (through its ``NearestRegionPicker``).
    """

    home: GeoPoint
    summary_ttl_s: float
    rtt_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    threshold: float = SPILL_THRESHOLD
    _nearest: NearestRegionPicker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"spill threshold must be positive, got {self.threshold}")
        self._nearest = NearestRegionPicker(self.home, self.summary_ttl_s, self.rtt_ms)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        ttl = self.summary_ttl_s
        rtt = self._nearest.rtt
        under: list[tuple[float, Child]] = []
        over: list[tuple[float, float, Child]] = []
        for c in children:
            if not may_route(c, request, now, ttl, True):
                continue
            used = spill_utilisation(c, request.model, now, ttl)
            if used < self.threshold:
                under.append((rtt(request, c), c))
            else:
                over.append((used, rtt(request, c), c))
        under.sort(key=lambda s: s[0])
        over.sort(key=lambda s: (s[0], s[1]))
        return [*(s[1] for s in under), *(s[2] for s in over)]
