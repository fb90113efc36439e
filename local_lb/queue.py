"""CentralQueue: where a request waits when every GPU that serves its model is full.

Late binding: the request side enqueues and awaits its ticket; the slot side
calls ``offer`` synchronously when a GPU frees a slot (or becomes routable)::

    ticket = queue.enqueue(model="m", tenant="t1", priority="standard",
                           cost_tokens=120, deadline=now + 2.0)
    gpu_name = await ticket.wait()      # QueueTimeout / QueueRejected; cancel to withdraw
    handed = queue.offer("g3", frozenset({"m"}))   # True: a waiter took the slot

``model`` is a ``queue_key``: ``"m"`` for any version, ``"m@2"`` for one; the
slot side offers the keys its GPU serves.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping
from functools import partial

from common.basics.vocabulary import PRIORITY_NAMES, Priority
from local_lb.queue_entries import (
    Lane,
    QueuedRequest,
    QueueFull,
    QueueRejected,
    QueueTimeout,
    QueueUnserved,
    split_key,
)
from local_lb.vtc import TenantWeights, VirtualTokenCounters


class CentralQueue:
    """The local tier's central queue: strict priority, then VTC fairness, then FIFO.

    Algorithm. ``offer(gpu, models)`` takes the highest priority class holding a
    live entry for one of ``models``. Inside it, each tenant has a virtual token
    counter; the tenant with the least counter among those waiting for a served
    model wins (ties: older head entry first), and its oldest such entry gets
    the slot; its counter then grows by ``cost_tokens / weight`` (``weights`` or
    ``set_weight``, default 1.0; ``local_lb.vtc``). A tenant that becomes
    backlogged is lifted to the least counter of the tenants already backlogged
    in the class — or, when none is, to the counter of the last tenant to leave
    — so idling banks no credit. Counters are per priority class: classes are
    served strictly, so a counter only ever competes within its class, and a
    tenant's critical traffic does not cost it its share of standard capacity. A
    tenant the ``may_take`` callback refuses (reserved headroom,
    ``local_lb.tenancy``) is passed over for this slot and keeps its place; the
    next in VTC order is asked.

    Admission. Beyond ``max_entries`` live entries, ``enqueue`` sheds the
    newest entry of the lowest class strictly below the newcomer (sheddable
    first) with QueueRejected("shed for higher priority"); if there is none it
    raises QueueFull. An entry past its deadline never gets a slot: a loop
    timer (``call_at``, cancelled on settle) fails it with QueueTimeout, and
    ``offer`` also expires overdue entries it meets, and fails with QueueTimeout
    those past their ``start_by`` (a slot given now would be GPU work wasted).
    ``fail_model`` fails every entry of a model nothing can serve any more.

    Cost. Entries sit in per-(class, model, tenant) FIFO lanes; each
    (class, model) has a heap of tenants keyed by (counter, head seq). Keys
    only grow, so a heap key may be stale-low and is re-keyed when it reaches
    the top: ``offer`` is O(|models| log tenants) amortised, plus O(log
    tenants) for each tenant ``may_take`` passes over.

    Caches: live counts per class and per (class, model), kept exact on every
    settle, so ``len``, ``depth_by_priority`` and ``expected_wait_s`` are O(1);
    settled entries linger in lanes until they reach an end or are compacted.

    Failure modes. A waiter cancelled in the same loop turn as its grant cannot
    take the slot: it goes back through ``release`` — the balancer frees it there
    and offers it again. Such a tenant stays charged for the lost grant. Counters
    and weights are kept for every tenant ever seen (one float each).
    """

    def __init__(
        self,
        *,
        release: Callable[[str], None],
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        may_take: Callable[[str], bool] | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._release = release
        self._clock = clock
        self._may_take = may_take
        self._seq = itertools.count()
        classes = range(len(Priority))
        self._live = 0
        self._live_by_class = [0 for _ in classes]
        self._live_by_model: dict[tuple[int, str], int] = {}
        self._by_class = [Lane() for _ in classes]  # all entries of a class, oldest first
        self._lanes: dict[tuple[int, str, str], Lane] = {}  # (class, model, tenant)
        self._heaps: dict[tuple[int, str], list[tuple[float, int, str]]] = {}
        self._weights = TenantWeights(weights)
        self._vtc = [VirtualTokenCounters(self._weights) for _ in classes]

    def enqueue(
        self,
        *,
        model: str,
        tenant: str,
        priority: str,
        cost_tokens: float,
        deadline: float | None = None,
        start_by: float | None = None,
    ) -> QueuedRequest:
        """Admit a request and return its ticket; raises QueueFull (see class doc).

        ``deadline`` bounds the wait; ``start_by`` (optional, earlier) is when the
        request could no longer finish in time once it got a slot."""
        known = Priority.parse(priority)
        if known is None:
            raise ValueError(f"priority must be one of {PRIORITY_NAMES}, got {priority!r}")
        rank = known.rank
        if not cost_tokens >= 1 or math.isinf(cost_tokens):
            raise ValueError(f"cost_tokens must be finite and at least 1, got {cost_tokens}")
        loop = asyncio.get_running_loop()
        now = self._clock()
        entry = QueuedRequest(
            model,
            tenant,
            priority,
            float(cost_tokens),
            deadline,
            now,
            loop.create_future(),
            start_by,
        )
        entry.seq = next(self._seq)
        if deadline is not None and deadline <= now:
            entry.settled = True
            entry.future.set_exception(QueueTimeout("deadline passed before queueing"))
            return entry
        if self._live >= self.max_entries:
            self._make_room(rank, now)
        self._admit(entry, rank, loop, now)
        return entry

    def set_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share relative to others (default 1.0); applies from the next grant."""
        self._weights.set(tenant, weight)

    def offer(
        self,
        gpu_name: str,
        models: frozenset[str],
    ) -> bool:
        """Hand one free slot of ``gpu_name`` to a waiter; False if none can use it."""
        now = self._clock()
        for rank in range(len(Priority)):
            if not self._live_by_class[rank]:
                continue
            best: tuple[float, int, str, str] | None = None
            for model in models:
                top = self._top(rank, model, now)
                if top is not None and (best is None or top < best):
                    best = top
            if best is None:
                continue
            _, _, model, tenant = best
            entry = self._lanes[(rank, model, tenant)].first()
            assert entry is not None  # _top just returned it as the live head
            entry.future.set_result(gpu_name)
            entry._grant = gpu_name
            self._settle(entry, charge=True)
            return True
        return False

    def __len__(self) -> int:
        return self._live

    def waiting_models(self) -> set[str]:
        """Queue keys (``queue_key``) with live entries, any class."""
        return {model for _, model in self._live_by_model}

    def fail_model(self, model: str, reason: str) -> int:
        """Fail every live entry waiting for ``model`` with QueueUnserved(reason): nothing
        here can serve it any more, so its waiters should go elsewhere now rather than
        at their deadline. Returns how many failed. O(lanes + entries of that model)."""
        failed = 0
        for (_, lane_model, _), lane in list(self._lanes.items()):
            if lane_model != model:
                continue
            for entry in list(lane.entries):
                if entry.settled:
                    continue
                if not entry.future.done():
                    entry.future.set_exception(QueueUnserved(reason))
                    failed += 1
                self._settle(entry, charge=False)
        return failed

    def weight(self, tenant: str) -> float:
        return self._weights(tenant)

    def depth_by_priority(self) -> dict[str, int]:
        return {p.value: self._live_by_class[p.rank] for p in Priority}

    def depth_for_model(self, model: str) -> int:
        """Live entries waiting for ``model``, any version, all priorities. O(keys)."""
        return sum(n for (_, key), n in self._live_by_model.items() if split_key(key)[0] == model)

    def oldest_wait_s(self, now: float) -> float:
        """How long the oldest waiting entry has waited (0.0 when nothing waits)."""
        oldest = [e.enqueued_at for lane in self._by_class if (e := self._live_first(lane))]
        return max(0.0, now - min(oldest)) if oldest else 0.0

    def expected_wait_s(
        self, priority: str, model: str, drain_rate_rps: float, tenant: str | None = None
    ) -> float:
        """Entries a new ``priority`` request for ``model`` would queue behind, over the
        rate at which that model's slots free up.

        Every live entry of a higher class is ahead. Of its own class, without a
        ``tenant`` all entries count (upper-leaning); with one, weighted fair sharing
        serves the newcomer after its own backlog, the other tenants taking
        ``total weight / own weight - 1`` turns for each of its turns — so a tenant
        flooding the queue cannot make everyone else's expected wait look hopeless.
        """
        rank = Priority(priority).rank
        ahead = sum(self._live_by_model.get((r, model), 0) for r in range(rank))
        same = self._live_by_model.get((rank, model), 0)
        if tenant is not None and same:
            same = min(same, self._vtc[rank].turns_until_served(tenant))
        ahead += same
        if ahead == 0:
            return 0.0
        return ahead / drain_rate_rps if drain_rate_rps > 0 else math.inf

    def _admit(
        self, entry: QueuedRequest, rank: int, loop: asyncio.AbstractEventLoop, now: float
    ) -> None:
        tenant = entry.tenant
        vtc = self._vtc[rank]
        vtc.arrive(tenant)
        key = (rank, entry.model, tenant)
        lane = self._lanes.get(key)
        if lane is None:  # a lane exists exactly while its tenant has an item in the heap
            lane = self._lanes[key] = Lane()
            heap = self._heaps.setdefault((rank, entry.model), [])
            heapq.heappush(heap, (vtc.counters[tenant], entry.seq, tenant))
        lane.entries.append(entry)
        self._by_class[rank].entries.append(entry)
        entry._lane, entry._queue = lane, self
        self._live += 1
        self._live_by_class[rank] += 1
        mkey = (rank, entry.model)
        self._live_by_model[mkey] = self._live_by_model.get(mkey, 0) + 1
        entry.future.add_done_callback(partial(self._on_done, entry))
        if entry.deadline is not None:
            when = loop.time() + (entry.deadline - now)
            entry._timer = loop.call_at(when, self._expire, entry)

    def _top(
        self,
        rank: int,
        model: str,
        now: float,
    ) -> tuple[float, int, str, str] | None:
        """The (counter, head seq, model, tenant) of the tenant due next for ``model``,
        skipping tenants ``may_take`` refuses (they keep their place in the heap)."""
        may_take = self._may_take
        heap = self._heaps.get((rank, model))
        if heap is None:
            return None
        counters = self._vtc[rank].counters
        passed_over: list[tuple[float, int, str]] = []
        found = None
        while heap:
            counter, seq, tenant = heap[0]
            head = self._usable_first(self._lanes[(rank, model, tenant)], now)
            if head is None:
                heapq.heappop(heap)
                del self._lanes[(rank, model, tenant)]
            elif (counter, seq) != (counters[tenant], head.seq):
                heapq.heapreplace(heap, (counters[tenant], head.seq, tenant))
            elif may_take is not None and not may_take(tenant):
                passed_over.append(heapq.heappop(heap))
            else:
                found = counter, seq, model, tenant
                break
        for item in passed_over:
            heapq.heappush(heap, item)
        if not heap:
            del self._heaps[(rank, model)]
        return found

    def _can_take(self, entry: QueuedRequest, now: float) -> bool:
        """True if ``entry`` may still get a slot; otherwise settle it (expire if overdue
        or too late to finish in time)."""
        if entry.future.done():  # cancelled; its done callback has not run yet
            self._settle(entry, charge=False)
        elif entry.deadline is not None and entry.deadline <= now:
            self._expire(entry)
        elif entry.start_by is not None and entry.start_by <= now:
            entry.future.set_exception(
                QueueTimeout("too late to start: it could no longer finish before its deadline")
            )
            self._settle(entry, charge=False)
        else:
            return True
        return False

    def _usable_first(self, lane: Lane, now: float) -> QueuedRequest | None:
        while (entry := lane.first()) is not None:
            if self._can_take(entry, now):
                return entry
        return None

    def _live_first(self, lane: Lane) -> QueuedRequest | None:
        while (entry := lane.first()) is not None and entry.future.done():
            self._settle(entry, charge=False)
        return entry

    def _make_room(self, rank: int, now: float) -> None:
        """Free one place: settle dead or overdue entries, else shed the newest lowest."""
        for lower in range(len(Priority) - 1, rank, -1):
            lane = self._by_class[lower]
            while self._live >= self.max_entries and (victim := lane.last()) is not None:
                if self._can_take(victim, now):
                    victim.future.set_exception(QueueRejected("shed for higher priority"))
                    self._settle(victim, charge=False)
            if self._live < self.max_entries:
                return
        raise QueueFull(
            f"central queue holds {self._live} entries (max_entries={self.max_entries}) "
            f"and none of lower priority than {PRIORITY_NAMES[rank]!r} to shed"
        )

    def _expire(self, entry: QueuedRequest) -> None:
        if entry.settled:
            return
        if not entry.future.done():
            waited = self._clock() - entry.enqueued_at
            entry.future.set_exception(
                QueueTimeout(f"deadline passed after {waited:.3f}s waiting for a slot")
            )
        self._settle(entry, charge=False)

    def _on_done(self, entry: QueuedRequest, future: asyncio.Future[str]) -> None:
        if future.cancelled():
            self._settle(entry, charge=False)

    def _abandon(self, entry: QueuedRequest) -> None:
        """The waiter was cancelled: drop its entry, and pass on a slot it never took."""
        self._settle(entry, charge=False)
        if entry._grant is not None:
            gpu_name = entry._grant
            entry._grant = None
            # Back through the owner of the slot, which checks the GPU is still usable
            # (not drained or ejected meanwhile) before offering it again.
            self._release(gpu_name)

    def _settle(self, entry: QueuedRequest, *, charge: bool) -> None:
        """Take a granted, failed or cancelled entry out of every live count, once."""
        if entry.settled:
            return
        entry.settled = True
        if entry._timer is not None:
            entry._timer.cancel()
            entry._timer = None
        rank = Priority(entry.priority).rank
        self._live -= 1
        self._live_by_class[rank] -= 1
        mkey = (rank, entry.model)
        if self._live_by_model[mkey] == 1:
            del self._live_by_model[mkey]
        else:
            self._live_by_model[mkey] -= 1
        self._vtc[rank].leave(entry.tenant, entry.cost_tokens if charge else 0.0)
        if entry._lane is not None:
            entry._lane.note_dead()
        self._by_class[rank].note_dead()
