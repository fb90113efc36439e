"""Each decision a tier's balancer makes, counted by its reason.

``DecisionCounter`` stands between a tier's forwarding loop and its balancer: every
``acquire`` is passed on, and its outcome handed to ``record`` (``TierMetrics.decided``)
with the reason as a bounded label value (``DECISION_REASONS``), so no balancer and no
picker makes a metric call. Decisions count per attempt: a failover is a decision of
its own ("failover").
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import grpc

from common.basics.errors import RouteError
from common.request.balancer import Balancer, Lease, Outcome
from common.request.children import Child
from common.request.pick import PickRequest

# A balancer's ``Lease.reason`` as a label value: the local tier's (prefix-cache hit,
# session affinity, least expected completion, the next ranked GPU when the best one's
# breaker was open, bound from the central queue, queued by reserved tenant headroom),
# then the regional and global tiers' ranking balancer (the nearest child, a spill past
# it, ranked without a known origin); a retry on another child is a failover. A reason
# not listed here counts as "other".
DECISION_REASONS = {
    "prefix": "prefix_hit",
    "session": "session",
    "least expected completion": "least_cost",
    "next ranked": "next_ranked",
    "queue": "queued",
    "reserved headroom": "reserved_headroom",
    "nearest zone": "home",
    "nearest region": "home",
    "ranked first": "ranked",
    "spill": "spill",
    "failover": "failover",
}
# No lease: refused for lack of capacity (RESOURCE_EXHAUSTED, so the tier above
# spills the request to another child), or no child could serve it at all.
REFUSED_FULL = "refused_full"
REFUSED = "refused"

Record = Callable[[PickRequest, str, Lease | None], None]


def decision_reason(reason: str) -> str:
    return DECISION_REASONS.get(reason, "other")


class DecisionCounter:
    """The tier's balancer as its forwarding loop sees it, counting each decision;
    everything else is the balancer's own."""

    def __init__(self, balancer: Balancer, record: Record) -> None:
        self.balancer = balancer
        self.record = record

    def ranked(self, pick: PickRequest) -> list[Child]:
        return self.balancer.ranked(pick)

    async def acquire(
        self, pick: PickRequest, tried: Collection[str], timeout: float | None
    ) -> Lease:
        try:
            lease = await self.balancer.acquire(pick, tried, timeout)
        except RouteError as err:
            full = err.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            self.record(pick, REFUSED_FULL if full else REFUSED, None)
            raise
        self.record(pick, decision_reason(lease.reason), lease)
        return lease

    def release(self, lease: Lease, outcome: Outcome) -> None:
        self.balancer.release(lease, outcome)
