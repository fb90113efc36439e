"""Reserved headroom: a light tenant finds a free slot even while another floods.

The central queue's VTC decides who gets a slot that frees up, but that alone
does not isolate tenants: while a flooding tenant holds every slot, a light
tenant still waits for one to free up, and every GPU runs at full batch, which
slows each decode step for everyone on it. So while a *light* tenant is active,
a *heavy* one may not take the last ``headroom`` fraction of the zone's usable
slots: the light tenant binds at once, as it would alone, and batches stay
smaller. With no light tenant active there is nobody to protect, and the zone
is work-conserving (the queue's VTC shares it).

Max-min fairness decides who is which: among the active tenants, one whose
demand (slots held + requests queued) reaches its weighted share of the usable
slots, or that was refused a slot within ``window_s``, is heavy; the others are
light. A tenant is active while it holds a slot or has requests queued, and for
``window_s`` after it last released a slot or was refused one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass
class TenantHeadroom:
    """Slots held per tenant, and whether a tenant may take a slot now."""

    headroom: float = 0.0
    window_s: float = 1.0
    # Live central-queue entries per tenant (tenants with none are absent).
    queued: Callable[[], Mapping[str, int]] = dict
    weight: Callable[[str], float] = lambda tenant: 1.0
    clock: Callable[[], float] = time.monotonic
    held: dict[str, int] = field(default_factory=dict)
    _released_at: dict[str, float] = field(default_factory=dict)
    _refused_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")

    def took(self, tenant: str) -> None:
        self.held[tenant] = self.held.get(tenant, 0) + 1

    def gave_back(self, tenant: str) -> None:
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
            self._released_at[tenant] = self.clock()

    def refused(self, tenant: str) -> None:
        """A request of ``tenant`` was refused, or timed out, waiting for a slot."""
        self._refused_at[tenant] = self.clock()

    def may_take(self, tenant: str, free_slots: int, usable_slots: int) -> bool:
        """May ``tenant`` take one of ``free_slots`` now? O(1) unless the zone is
        into its headroom; then O(active tenants)."""
        if free_slots - 1 >= self.headroom * usable_slots:
            return True
        now = self.clock()
        queued = self.queued()
        active = self._active(now, queued)
        active.add(tenant)
        if len(active) < 2:
            return True
        fair_unit = usable_slots / sum(self.weight(t) for t in active)

        def heavy(t: str) -> bool:
            demand = self.held.get(t, 0) + queued.get(t, 0)
            return t in self._refused_at or demand >= fair_unit * self.weight(t)

        return not heavy(tenant) or all(heavy(t) for t in active if t != tenant)

    def _active(self, now: float, queued: Mapping[str, int]) -> set[str]:
        """Tenants holding or waiting for slots, or recently; forgets the others."""
        for recent in (self._released_at, self._refused_at):
            for t in [t for t, at in recent.items() if now - at >= self.window_s]:
                del recent[t]
        return {*self.held, *queued, *self._released_at, *self._refused_at}
