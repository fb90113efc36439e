"""How a tier turns a picker's ranking into a reserved child for one attempt.

The proxy core asks its balancer for a ``Lease`` before each attempt and gives
it back with the ``Outcome``. ``RankingBalancer`` (regional and global tiers)
walks the picker's ranking, skipping children already tried. The local tier
has its own balancer with slots, a central queue and outlier ejection
(``local_lb/balancer.py``); both satisfy ``Balancer``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from opentelemetry.trace import Span

from common.basics.errors import RouteError
from common.basics.geo import great_circle_km
from common.capacity.summary import CAPACITY_HINT, decode_hint
from common.gen.meridian.v1 import capacity_pb2
from common.request.children import Child, ChildSet
from common.request.pick import Picker, PickRequest
from common.request.routing import trailer

# Decoded capacity hints a RankingBalancer remembers (texts seen since its children
# last published; more than enough for a tier's children between two publications).
HINT_CACHE_SIZE = 1024

# Status codes that say the child itself is broken or unreachable.
CHILD_FAULT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
    }
)


@dataclass(slots=True)
class Lease:
    """A child reserved for one attempt of one request, and why it was chosen.

    The balancer fills in the decision (``reason``, ``candidates`` and, where it
    knows them, ``estimated_s``, ``queued_s``, ``policy``) for the trace; the
    proxy keeps the attempt's client span in ``span`` until it settles the lease.
    """

    child: Child
    # Tokens the attempt may cost (an upper tier's: prompt plus cap, the basis of its
    # per-try limit) or, at the local tier, the work it puts on its GPU.
    work: float
    started_at: float
    model: str = ""
    # Decode tokens the lease's work was planned at (PickRequest.output_tokens), and
    # the client's cap (PickRequest.max_tokens), which the answer's length is learned by.
    planned_output: int = 0
    max_tokens: int = 0
    tenant: str = ""
    # Requests in flight on the child when this one started (itself included).
    concurrent: int = 1
    reason: str = ""
    # How many children the picker ranked.
    candidates: int = 0
    # The completion time the policy expected, when it estimates one.
    estimated_s: float | None = None
    # How long the attempt takes at the child's normal speed, the basis of its
    # per-try timeout (common.config.liveness.PerTryTimeout); None: no estimate.
    expected_s: float | None = None
    # Time spent waiting in a queue before the child was bound.
    queued_s: float | None = None
    policy: str = ""
    # Prefix blocks the child already holds (a local tier's prefix index says).
    cached_blocks: int = 0
    # The lease holds a circuit-breaker slot on its child (released with it).
    holds_breaker: bool = False
    # An upper tier's share of its child's outstanding_work: the request's planned
    # work (PickRequest.work), what the child's backlog grows by until it reports.
    backlog_work: float = 0.0
    span: Span | None = None


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the balancer needs to learn from it."""

    code: grpc.StatusCode
    elapsed_s: float
    # The answer's length as the child reported it (None: failed, or not reported).
    completion_tokens: int | None = None
    trailers: Any = ()
    detail: str = ""
    # Cancelled by its per-try timeout: the child sent nothing back in time.
    timed_out: bool = False

    @property
    def child_fault(self) -> bool:
        return self.code in CHILD_FAULT_CODES


class Balancer(Protocol):
    """Reserves a child for an attempt and learns from how it ended."""

    async def acquire(
        self, pick: PickRequest, tried: Collection[str], timeout: float | None
    ) -> Lease: ...

    def release(self, lease: Lease, outcome: Outcome) -> None: ...

    def ranked(self, pick: PickRequest) -> list[Child]: ...


class RankingBalancer:
    """The next child in the picker's ranking that was not tried yet."""

    def __init__(self, picker: Picker, children: ChildSet) -> None:
        self.picker = picker
        self.children = children
        # Decoded capacity hints by trailer text: a child answers with the same text
        # until it publishes again, so most answers need no parsing (bounded).
        self._hints: dict[tuple[str, str], capacity_pb2.ModelCapacity | None] = {}

    def ranked(self, pick: PickRequest) -> list[Child]:
        return self.picker.rank(pick, self.children.children, self.children.clock())

    async def acquire(
        self, pick: PickRequest, tried: Collection[str], timeout: float | None
    ) -> Lease:
        ranked = self.ranked(pick)
        for child in ranked:
            if child.name not in tried:
                child.outstanding_requests += 1
                child.outstanding_work += pick.work
                return Lease(
                    child,
                    pick.work_tokens,
                    self.children.clock(),
                    model=pick.model,
                    planned_output=pick.output_tokens,
                    max_tokens=pick.max_tokens,
                    tenant=pick.tenant,
                    candidates=len(ranked),
                    reason=self.reason(pick, child, ranked, tried),
                    backlog_work=pick.work,
                )
        reason = self.children.nothing_healthy(pick.model, tried, pick.allowed_regions)
        if pick.allowed_regions:
            allowed = ", ".join(sorted(pick.allowed_regions))
            reason = f"data residency: this tenant may be served only in {allowed}; {reason}"
        raise RouteError.unavailable(reason)

    def reason(
        self, pick: PickRequest, child: Child, ranked: list[Child], tried: Collection[str]
    ) -> str:
        """Why ``child`` was chosen, for the decision span: a failover, the nearest
        child, or a spill away from the nearest (no headroom or its share used up)."""
        if tried:
            return "failover"
        origin = pick.origin
        if origin is None or child.location is None:
            return "ranked first"
        # ``child`` is the nearest as ``min`` over ``ranked`` by distance would find it:
        # strictly nearer than every child before it, no farther than any after it.
        km = great_circle_km(origin, child.location)
        before = True
        for c in ranked:
            if c is child:
                before = False
                continue
            other = great_circle_km(origin, c.location) if c.location else 1e9
            if other < km or (before and other == km):
                return "spill"
        return f"nearest {self.children.kind}" if not before else "spill"

    def release(self, lease: Lease, outcome: Outcome) -> None:
        hint = self._hint(trailer(outcome.trailers, CAPACITY_HINT), lease.model)
        # The hint first: the report it carries was made while this request was in
        # flight, so it counts the request busy, and its return is counted after.
        self.children.take_hint(lease.child, hint)
        lease.child.outstanding_requests -= 1
        lease.child.outstanding_work -= lease.backlog_work
        if outcome.child_fault and hint is None:
            # No hint: the child itself did not answer (a tier that answers with a
            # hint is up, and the hint says what it lacks).
            self.children.mark_failed(lease.child, f"{outcome.code.name}: {outcome.detail}")

    def _hint(self, value: str | None, model: str) -> capacity_pb2.ModelCapacity | None:
        """``decode_hint``, remembered per text (a decoded hint is only read, never
        written, so children answering with the same text may share it)."""
        if not value:
            return None
        key = (value, model)
        try:
            return self._hints[key]
        except KeyError:
            pass
        if len(self._hints) >= HINT_CACHE_SIZE:
            self._hints.clear()
        hint = self._hints[key] = decode_hint(value, model)
        return hint
