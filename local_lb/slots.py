"""Slot accounting: which GPU slots are held, and how many usable ones are free."""

from __future__ import annotations

from dataclasses import dataclass, field

from local_lb.publication import UtilisationBands
from local_lb.state import GpuChild, LocalView


@dataclass
class SlotLedger:
    """Reserves and frees GPU slots, keeping the zone's slot totals exact.

    Algorithm: a slot is one request in flight on a GPU (``GpuChild.slots`` of
    them). ``reserve``/``unreserve`` move a GPU's count, the zone's total, and (if
    the GPU is usable) the usable in-flight count, then put the GPU in or out of
    its free pools and let ``bands`` see the new utilisation.

    Caches the totals (all slots, usable slots, usable in flight) so that
    ``free_usable_slots`` is O(1) on every request; they go stale when a GPU's
    usability or the GPU set changes, and ``recount`` (O(GPUs)) re-derives them.
    Failure mode: a usability change without ``recount`` would leave the usable
    counts off until the next one (the balancer recounts on every such change and
    on its refresh tick).
    """

    view: LocalView
    bands: UtilisationBands = field(default_factory=UtilisationBands)
    total_slots: int = field(init=False)
    usable_slots: int = field(init=False)
    usable_inflight: int = field(init=False)

    def __post_init__(self) -> None:
        # Not field defaults: init=False fields with defaults stay unset on a class
        # mypyc compiles (sim.native).
        self.total_slots = self.usable_slots = self.usable_inflight = 0
        self.recount()

    def reserve(self, gpu: GpuChild) -> None:
        self._move(gpu, +1)

    def unreserve(self, gpu: GpuChild) -> None:
        self._move(gpu, -1)

    def _move(self, gpu: GpuChild, by: int) -> None:
        gpu.outstanding_requests += by
        self.view.inflight_total += by
        if gpu.usable:
            self.usable_inflight += by
        self.view.refresh(gpu)
        self.bands.observe(self.view.inflight_total, self.total_slots)

    @property
    def free_usable_slots(self) -> int:
        """Free slots on GPUs that may take requests (down, ejected, drained ones not)."""
        return self.usable_slots - self.usable_inflight

    def recount(self) -> None:
        """Re-derive the totals after a change of a GPU's usability or of the GPU set."""
        self.total_slots = sum(g.slots for g in self.view.gpus)
        usable = [g for g in self.view.gpus if g.usable]
        self.usable_slots = sum(g.slots for g in usable)
        self.usable_inflight = sum(g.outstanding_requests for g in usable)
