"""Reserved headroom: a light tenant finds a free slot even while another floods.

The central queue's VTC decides who gets a slot that frees up, but that alone
does not isolate tenants: while a flooding tenant holds every slot, a light
tenant still waits for one to free up, and every GPU runs at full batch, which
slows each decode step for everyone on it. So while a *light* tenant is active,
a *heavy* one may not take the last ``headroom`` fraction of the zone's usable
slots: the light tenant binds at once, as it would alone, and batches stay
smaller. With no light tenant active there is nobody to protect, and the zone
is work-conserving (the queue's VTC shares it).

Who is which follows max-min fairness on *offered* load: a tenant whose arrival
rate (in work tokens per second, decayed over ``window_s``) reaches its weighted
share of the zone's capacity is heavy, the others are light. Offered load, not
slots held, so that a light tenant whose requests slow down (a stall, a busy
GPU) does not start to look heavy and lose its protection just when it needs it.
A tenant is active while it holds a slot and for ``window_s`` after its last
request. The classification is kept for ``reclassify_s`` (50 ms), so deciding
costs O(1) per request, not O(tenants). A heavy tenant may always take one slot
of an idle zone, however small. Requests held back are reconsidered at the next
release on a GPU serving their model, or at the tier's refresh tick
(``health_interval_s`` / 2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Arrivals:
    decayed_work: float = 0.0
    last_at: float = float("-inf")


@dataclass
class TenantHeadroom:
    """Each tenant's offered load and slots held, and whether it may take a slot."""

    headroom: float = 0.0
    window_s: float = 2.0
    reclassify_s: float = 0.05
    weight: Callable[[str], float] = lambda tenant: 1.0
    clock: Callable[[], float] = time.monotonic
    held: dict[str, int] = field(default_factory=dict)
    _arrivals: dict[str, _Arrivals] = field(default_factory=dict)
    _light: set[str] = field(default_factory=set)
    _heavy: set[str] = field(default_factory=set)
    _classified_at: float = float("-inf")

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")

    def arrived(self, tenant: str, work: float) -> None:
        """A request of ``tenant`` asking for ``work`` tokens came to the zone."""
        now = self.clock()
        a = self._arrivals.get(tenant)
        if a is None:
            a = self._arrivals[tenant] = _Arrivals()
        a.decayed_work = a.decayed_work * self._decay(now - a.last_at) + work
        a.last_at = now

    def offered_rate(self, tenant: str) -> float:
        """Work tokens per second ``tenant`` has been sending lately."""
        a = self._arrivals.get(tenant)
        if a is None:
            return 0.0
        return a.decayed_work * self._decay(self.clock() - a.last_at) / self.window_s

    def took(self, tenant: str) -> None:
        self.held[tenant] = self.held.get(tenant, 0) + 1

    def gave_back(self, tenant: str) -> None:
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)

    def may_take(
        self, tenant: str, free_slots: int, usable_slots: int, capacity_work_per_s: float
    ) -> bool:
        """May ``tenant`` take one of ``free_slots`` now? O(1) amortised."""
        reserve = min(self.headroom * usable_slots, usable_slots - 1)
        if self.headroom == 0 or free_slots - 1 >= reserve:
            return True
        now = self.clock()
        if now - self._classified_at >= self.reclassify_s or (
            tenant not in self._light and tenant not in self._heavy
        ):
            self._classify(tenant, capacity_work_per_s, now)
        # Kept out only if heavy while some other tenant is light.
        return tenant in self._light or not self._light

    def _classify(self, tenant: str, capacity_work_per_s: float, now: float) -> None:
        """Max-min on offered load: who among the active tenants is light, who heavy."""
        active = self._active()
        active.add(tenant)
        unit = capacity_work_per_s / sum(self.weight(t) for t in active)
        self._light, self._heavy = set(), set()
        for t in active:
            heavy = self.offered_rate(t) >= unit * self.weight(t)
            (self._heavy if heavy else self._light).add(t)
        self._classified_at = now

    def _active(self) -> set[str]:
        """Tenants holding slots or heard from within the window; forgets the rest."""
        now = self.clock()
        active = set(self.held)
        for t, a in list(self._arrivals.items()):
            if now - a.last_at < self.window_s:
                active.add(t)
            elif t not in self.held:
                del self._arrivals[t]
        return active

    def _decay(self, age_s: float) -> float:
        return math.exp(-age_s / self.window_s) if age_s > 0 else 1.0
