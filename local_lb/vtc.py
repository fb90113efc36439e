"""Virtual token counters: how the central queue shares one priority class by tenant."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping


class TenantWeights:
    """Each tenant's share relative to others (default 1.0), for every priority class.

    Caches nothing beyond the mapping; a change applies from the next grant.
    """

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights: dict[str, float] = {}
        for tenant, weight in (weights or {}).items():
            self.set(tenant, weight)

    def set(self, tenant: str, weight: float) -> None:
        if not weight > 0 or math.isinf(weight):
            raise ValueError(f"weight for tenant {tenant!r} must be positive, got {weight}")
        self._weights[tenant] = weight

    def __call__(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)


class VirtualTokenCounters:
    """The virtual token counters (VTC) of one priority class.

    Algorithm: each tenant has a counter of the service it received, in tokens
    over its weight; the queue serves the backlogged tenant with the least counter
    and ``leave(..., charged_tokens)`` grows it. A tenant that becomes backlogged
    (``arrive`` with no live entry) is lifted to the least counter of the tenants
    already backlogged — or, when none is, to the counter of the last tenant to
    leave — so idling banks no credit.

    Caches the backlogged tenants in a min-heap of (counter, tenant) whose keys may
    be stale-low (counters only grow); a stale top is re-keyed or dropped when
    asked, so the backlogged minimum is O(log tenants) amortised. Failure mode:
    counters are kept for every tenant ever seen (one float each), never pruned.
    """

    def __init__(self, weights: TenantWeights) -> None:
        self._weight = weights
        self.counters: dict[str, float] = {}
        self.backlog: dict[str, int] = {}  # live entries per tenant
        self._min_heap: list[tuple[float, str]] = []
        self._in_min_heap: set[str] = set()
        self._last_left = 0.0

    def arrive(self, tenant: str) -> None:
        """``tenant`` has one more live entry in this class."""
        if tenant not in self.backlog:
            self._join(tenant)
        self.backlog[tenant] = self.backlog.get(tenant, 0) + 1

    def leave(self, tenant: str, charged_tokens: float = 0.0) -> None:
        """One live entry of ``tenant`` left; ``charged_tokens`` if it got a slot."""
        if charged_tokens:
            self.counters[tenant] += charged_tokens / self._weight(tenant)
        if self.backlog[tenant] == 1:
            del self.backlog[tenant]
            self._last_left = self.counters[tenant]
        else:
            self.backlog[tenant] -= 1

    def turns_until_served(self, tenant: str) -> int:
        """Entries of this class served before a new one of ``tenant`` under weighted
        fair sharing: its own backlog, with the other tenants taking ``total weight /
        own weight - 1`` turns for each of its turns."""
        backlog = self.backlog
        weight = self._weight(tenant)
        total = sum(self._weight(t) for t in backlog)
        if tenant not in backlog:
            total += weight
        fair = (backlog.get(tenant, 0) + 1) * total / weight - 1
        return max(0, math.ceil(fair))

    def _join(self, tenant: str) -> None:
        """VTC lift: a newly backlogged tenant starts no lower than the backlogged minimum."""
        counters = self.counters
        floor = self._min_backlogged()
        if floor is None:
            floor = self._last_left
        counters[tenant] = max(counters.get(tenant, 0.0), floor)
        if tenant not in self._in_min_heap:
            self._in_min_heap.add(tenant)
            heapq.heappush(self._min_heap, (counters[tenant], tenant))

    def _min_backlogged(self) -> float | None:
        heap, counters, backlog = self._min_heap, self.counters, self.backlog
        while heap:
            counter, tenant = heap[0]
            if tenant not in backlog:
                heapq.heappop(heap)
                self._in_min_heap.discard(tenant)
            elif counter != counters[tenant]:
                heapq.heapreplace(heap, (counters[tenant], tenant))
            else:
                return counter
        return None
