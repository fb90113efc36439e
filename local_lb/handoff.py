"""Queue hand-off: freed slots go to queued requests; hopeless waiters fail early."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from common.request.children import ChildSet
from local_lb.queue import CentralQueue
from local_lb.queue_entries import split_key
from local_lb.slots import SlotLedger
from local_lb.state import GpuChild, LocalView


class QueueHandOff:
    """Owns the central queue and binds its waiters to the slots GPUs free.

    Algorithm: ``offer_free_slots(gpu)`` offers each free slot of a usable GPU to the
    queue, restricted to the queue keys (model, or model@version) the GPU serves,
    and reserves the slot for each waiter the queue grants (late binding).
    ``fail_unservable`` fails, with UNAVAILABLE, the waiters of any model that no
    usable GPU serves any more, so the tier above fails them over now rather than
    at their deadline.

    Failure mode: a waiter cancelled in the same loop turn as its grant cannot take
    its slot; the queue hands it back (``granted_slot_abandoned``), which frees the
    slot and offers it again if the GPU is still usable. Caches nothing: the keys a
    GPU serves are derived per hand-off from the keys actually waiting.
    """

    def __init__(
        self,
        *,
        view: LocalView,
        slots: SlotLedger,
        children: ChildSet,
        may_take: Callable[[str], bool],
        tenant_weights: Mapping[str, float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._view = view
        self._slots = slots
        self._children = children
        self.queue = CentralQueue(
            release=self.granted_slot_abandoned,
            clock=clock,
            may_take=may_take,
            weights=tenant_weights,
        )

    def offer_free_slots(self, gpu: GpuChild) -> None:
        """Give the GPU's free slots to queued requests, best first."""
        queue = self.queue
        if not (len(queue) and gpu.usable and gpu.free_slots > 0):
            return
        keys = frozenset(k for k in queue.waiting_models() if gpu.serves(*split_key(k)))
        while gpu.free_slots > 0 and queue.offer(gpu.name, keys):
            self._slots.reserve(gpu)

    def granted_slot_abandoned(self, name: str) -> None:
        """A waiter was cancelled after the queue granted it a slot: free the slot
        and offer it again (if the GPU is still usable)."""
        gpu = self._view.by_name.get(name)
        if gpu is None:  # cannot happen: a GPU leaves only once nothing is in flight on it
            return
        self._slots.unreserve(gpu)
        self.offer_free_slots(gpu)

    def fail_unservable(self) -> None:
        """Queued requests for a model no usable GPU serves any more (down, ejected,
        drained) fail now with UNAVAILABLE, instead of waiting out their deadline."""
        queue = self.queue
        for key in queue.waiting_models() if len(queue) else ():
            model, version = split_key(key)
            if not any(g.usable for g in self._view.serving(model, version)):
                queue.fail_model(key, self._children.nothing_healthy(model, ()))
