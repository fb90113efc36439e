"""LocalBalancer: from a picker's ranking to one reserved GPU slot, with late binding.

Per attempt it asks the policy for a ranking of GPUs that have a free slot,
and reserves the first one it may use (not tried yet, serving the version,
circuit breaker closed). When every eligible GPU is full, the request waits
in the ``CentralQueue`` (strict priority, then tenant fairness) and is bound
to the first GPU that frees a slot; if its expected wait already exceeds its
deadline it is refused at once with RESOURCE_EXHAUSTED and ``retry-after-ms``,
so the regional tier can try another zone.

It learns from every finished attempt: the GPU's service rate (EWMA of work
per second under its batch), its latency (for ``least_response_time``), its
load report from the response trailer, and success or failure for Envoy-style
outlier ejection. An ejected or unhealthy GPU leaves the free pools; a
recovered one comes back through slow start.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import grpc

from common.basics.errors import RouteError
from common.capacity.summary import utilisation_band
from common.request.balancer import Lease, Outcome
from common.request.children import Child, ChildSet
from common.request.pick import Picker, PickRequest
from common.request.prefix import BLOCK_TOKENS
from common.request.resilience import (
    CircuitBreaker,
    OutlierConfig,
    OutlierDetector,
    SlowStart,
    SlowStartConfig,
)
from local_lb.cost import (
    drain_rps,
    ewma,
    expected_completion_s,
    outstanding_work,
    rate_sample,
    request_work,
)
from local_lb.queue import (
    CentralQueue,
    QueueFull,
    QueueRejected,
    QueueTimeout,
    QueueUnserved,
    queue_key,
    split_key,
)
from local_lb.state import GpuChild, LocalView
from local_lb.tenancy import TenantHeadroom

log = logging.getLogger(__name__)
ANONYMOUS = "anonymous"


@dataclass
class LocalBalancer:
    """Slots, central queue, learning and ejection around a local picker."""

    view: LocalView
    picker: Picker
    children: ChildSet
    outlier_config: OutlierConfig = field(default_factory=OutlierConfig)
    slow_start_config: SlowStartConfig = field(default_factory=SlowStartConfig)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    max_queue_wait_s: float = 30.0
    # Fraction of usable slots a heavy tenant may not take while a light one is
    # active (local_lb.tenancy).
    tenant_headroom: float = 0.0
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.queue = CentralQueue(
            release=self._granted_slot_abandoned, clock=self.clock, may_take=self._may_take
        )
        self.outlier = OutlierDetector(
            self.outlier_config,
            clock=self.clock,
            total_children=len(self.view.gpus),
            on_change=self._ejection_changed,
        )
        self.slow_start = SlowStart(self.slow_start_config, clock=self.clock)
        self._recount()
        self.tenants = TenantHeadroom(
            self.tenant_headroom, weight=self.queue.weight, clock=self.clock
        )
        # Typical work tokens per request here (EWMA): with service_s, the zone's capacity.
        self.work_ewma = 0.0
        self._band = 0
        # Typical time a request takes on a GPU here (EWMA of OK requests).
        self.service_s = 0.0
        # Called when the zone's utilisation crosses a band (its summary goes out at once).
        self.on_significant_change: Callable[[], None] = lambda: None
        self.children.add_listener(self.refresh_all)
        self.policy_name = type(self.picker).__name__

    # ------------------------------------------------------------------ request side

    def ranked(self, pick: PickRequest) -> list[Child]:
        pool = self.view.free.get(pick.model)
        if pool is None:
            return []
        return self.picker.rank(pick, pool, self.clock())

    async def acquire(
        self, pick: PickRequest, tried: Collection[str], timeout: float | None
    ) -> Lease:
        serving = self.view.serving(pick.model, pick.version)
        if not serving:
            what = f"{pick.model!r} version {pick.version!r}" if pick.version else repr(pick.model)
            raise RouteError.not_found(f"no GPU in this zone serves model {what}")
        ranking = self.ranked(pick)
        tenant = pick.tenant or ANONYMOUS
        work = max(1.0, pick.work_tokens)
        self.work_ewma = ewma(self.work_ewma, work) if self.work_ewma else work
        self.tenants.arrived(tenant, work)
        held_back = self.free_usable_slots > 0 and not self._may_take(tenant)
        for gpu in () if held_back else self._candidates(pick, tried, ranking):
            if self.breaker.try_acquire(gpu.name):
                self._reserve(gpu)
                lease = self._lease(gpu, pick, breaker=True, tried=tried)
                lease.candidates = len(ranking)
                if ranking and gpu is not ranking[0] and lease.reason != "failover":
                    lease.reason = "next ranked"  # the best one's breaker was open
                return lease
        if not any(g.usable for g in serving):
            raise RouteError.unavailable(self.children.nothing_healthy(pick.model, tried))
        queued_at = self.clock()
        gpu = await self._wait_in_queue(pick, serving, timeout)
        lease = self._lease(gpu, pick, breaker=False, tried=tried)
        lease.reason = "reserved headroom" if held_back else "queue"
        lease.queued_s = self.clock() - queued_at
        lease.candidates = len(ranking)
        return lease

    def _candidates(
        self, pick: PickRequest, tried: Collection[str], ranking: list[Child]
    ) -> Iterator[GpuChild]:
        """The policy's ranking, then (on a retry whose ranked GPUs were all tried
        already) any other free GPU: a retry never queues while a GPU is free."""
        for gpu in ranking:
            assert isinstance(gpu, GpuChild)
            if (
                gpu.name not in tried
                and gpu.free_slots > 0
                and gpu.serves(pick.model, pick.version)
            ):
                yield gpu
        if tried:
            for gpu in list(self.view.free.get(pick.model, ())):
                if gpu.name not in tried and gpu.serves(pick.model, pick.version):
                    yield gpu

    async def _wait_in_queue(
        self, pick: PickRequest, serving: tuple[GpuChild, ...], timeout: float | None
    ) -> GpuChild:
        """Late binding: wait for the first slot any serving GPU frees."""
        drain = max(drain_rps(serving), 1e-3)
        service_s = self.expected_service_s(max(1.0, pick.work_tokens))
        key = queue_key(pick.model, pick.version)
        expected = self.queue.expected_wait_s(pick.priority, key, drain, pick.tenant)
        # Shed at once what could not finish in time anyway: a slot given to it would
        # be GPU work wasted (and a prefill stall for everyone in its batch).
        if timeout is not None and expected + service_s > timeout:
            raise RouteError.exhausted(
                f"every GPU for {pick.model!r} is full and the expected queue wait "
                f"({expected:.2f}s) plus service ({service_s:.2f}s) exceeds the request's "
                f"remaining deadline ({timeout:.2f}s)",
                retry_after_ms=max(1, int(expected * 1000)),
            )
        # A request without a deadline still waits a bounded time; one with a deadline
        # is not granted a slot once it could no longer finish in time.
        now = self.clock()
        deadline = now + (self.max_queue_wait_s if timeout is None else timeout)
        try:
            ticket = self.queue.enqueue(
                model=key,
                tenant=pick.tenant or ANONYMOUS,
                priority=pick.priority,
                cost_tokens=max(1.0, pick.work_tokens),
                deadline=deadline,
                start_by=None if timeout is None else deadline - service_s,
            )
            name = await ticket.wait()
        except QueueTimeout as exc:
            raise RouteError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"waiting for a free GPU slot for {pick.model!r}: {exc}",
            ) from None
        except QueueUnserved as exc:
            raise RouteError.unavailable(str(exc)) from None
        except (QueueFull, QueueRejected) as exc:
            retry = max(1, int(1000 * expected)) if expected else 1000
            raise RouteError.exhausted(f"local queue is full: {exc}", retry) from None
        return self.view.by_name[name]  # the slot was reserved for us by _hand_off

    def _lease(
        self, gpu: GpuChild, pick: PickRequest, *, breaker: bool, tried: Collection[str]
    ) -> Lease:
        cached = 0
        if pick.prefix_blocks:
            cached = self.view.prefix.matches(pick.prefix_blocks, 8).get(gpu.name, 0)
            self.view.prefix.record(pick.prefix_blocks, gpu.name)
        work = request_work(pick.prompt_tokens, pick.max_tokens, cached * BLOCK_TOKENS)
        now = self.clock()
        # The completion time the policy expects (work ahead excludes this request).
        ahead = outstanding_work(
            gpu.outstanding_work,
            gpu.outstanding_requests - 1,
            self.view.reported_requests(gpu, now),
            gpu.slots,
        )
        gpu.outstanding_work += work
        tenant = pick.tenant or ANONYMOUS
        self.tenants.took(tenant)
        if tried:
            reason = "failover"
        elif pick.session:
            reason = "session"
        elif cached:
            reason = "prefix"
        else:
            reason = "least expected completion"
        return Lease(
            gpu,
            work,
            now,
            model=pick.model,
            max_tokens=pick.max_tokens,
            tenant=tenant,
            concurrent=gpu.outstanding_requests,
            holds_breaker=breaker,
            reason=reason,
            estimated_s=expected_completion_s(ahead, work, gpu.rate, max(gpu.share, 1e-3)),
            policy=self.policy_name,
        )

    def expected_service_s(self, work: float) -> float:
        """How long a request of ``work`` tokens typically takes on a GPU here: the
        zone's typical service time scaled by its size (0 until one has finished)."""
        if not self.service_s or not self.work_ewma:
            return 0.0
        return self.service_s * work / self.work_ewma

    # ------------------------------------------------------------------ completion side

    def release(self, lease: Lease, outcome: Outcome) -> None:
        gpu = lease.child
        assert isinstance(gpu, GpuChild)
        gpu.outstanding_work -= lease.work
        self.tenants.gave_back(lease.tenant)
        if lease.holds_breaker:
            self.breaker.release(gpu.name)
        try:
            self._learn(gpu, lease, outcome)
        finally:  # whatever learning does, the slot comes back
            self._unreserve(gpu)
            self._hand_off(gpu)

    def _learn(self, gpu: GpuChild, lease: Lease, outcome: Outcome) -> None:
        now = self.clock()
        self.view.load.record_trailer(gpu.name, outcome.trailers, now)
        if outcome.code == grpc.StatusCode.OK:
            self.outlier.record_success(gpu.name)
            sample = rate_sample(lease.work, outcome.elapsed_s, lease.concurrent)
            if sample is not None:
                gpu.rate = ewma(gpu.rate, sample)
            gpu.latency_ewma_s = (
                ewma(gpu.latency_ewma_s, outcome.elapsed_s)
                if gpu.latency_ewma_s
                else outcome.elapsed_s
            )
            self.service_s = (
                ewma(self.service_s, outcome.elapsed_s) if self.service_s else outcome.elapsed_s
            )
        elif outcome.child_fault:
            self.outlier.record_failure(gpu.name)
            if outcome.code == grpc.StatusCode.UNAVAILABLE:
                self.children.mark_failed(gpu, f"UNAVAILABLE: {outcome.detail}")

    def _granted_slot_abandoned(self, name: str) -> None:
        """A waiter was cancelled after the queue granted it a slot: free the slot
        and offer it again (if the GPU is still usable)."""
        gpu = self.view.by_name.get(name)
        if gpu is None:  # cannot happen: a GPU leaves only once nothing is in flight on it
            return
        self._unreserve(gpu)
        self._hand_off(gpu)

    # ------------------------------------------------------------------ slot accounting

    def _reserve(self, gpu: GpuChild) -> None:
        gpu.outstanding_requests += 1
        self.view.inflight_total += 1
        if gpu.usable:
            self._usable_inflight += 1
        self.view.refresh(gpu)
        self._check_band()

    def _unreserve(self, gpu: GpuChild) -> None:
        gpu.outstanding_requests -= 1
        self.view.inflight_total -= 1
        if gpu.usable:
            self._usable_inflight -= 1
        self.view.refresh(gpu)
        self._check_band()

    def _check_band(self) -> None:
        band = utilisation_band(self.view.inflight_total / max(1, self.total_slots))
        if band != self._band:
            self._band = band
            self.on_significant_change()

    def _hand_off(self, gpu: GpuChild) -> None:
        """Give the GPU's free slots to queued requests, best first."""
        if not (len(self.queue) and gpu.usable and gpu.free_slots > 0):
            return
        # The queue keys (model, or model@version) this GPU can serve.
        keys = frozenset(k for k in self.queue.waiting_models() if gpu.serves(*split_key(k)))
        while gpu.free_slots > 0 and self.queue.offer(gpu.name, keys):
            self._reserve(gpu)

    @property
    def free_usable_slots(self) -> int:
        """Free slots on GPUs that may take requests (down, ejected, drained ones not)."""
        return self.usable_slots - self._usable_inflight

    def _recount(self) -> None:
        """Re-derive the slot totals; after any change of a GPU's usability or of the
        GPU set (a reload calls ``refresh_all``)."""
        self.total_slots = sum(g.slots for g in self.view.gpus)
        usable = [g for g in self.view.gpus if g.usable]
        self.usable_slots = sum(g.slots for g in usable)
        self._usable_inflight = sum(g.outstanding_requests for g in usable)

    def _may_take(self, tenant: str) -> bool:
        """Reserved headroom (local_lb.tenancy): may ``tenant`` take a free slot now?"""
        # Work tokens per second the zone finishes with every usable slot busy; unknown
        # (nothing finished yet): infinite, so nobody counts as heavy.
        capacity = (
            self.usable_slots * self.work_ewma / self.service_s if self.service_s else math.inf
        )
        return self.tenants.may_take(tenant, self.free_usable_slots, self.usable_slots, capacity)

    # ------------------------------------------------------------------ state changes

    def _ejection_changed(self, name: str, ejected: bool) -> None:
        gpu = self.view.by_name.get(name)
        if gpu is None:  # removed by a reload
            return
        gpu.ejected = ejected
        self._recount()
        if ejected:
            log.warning("GPU %s ejected after consecutive failures", name)
            self._fail_unservable()
        else:
            self.slow_start.start(name)
            gpu.share = self.slow_start.factor(name)
        self.view.refresh(gpu)
        self._hand_off(gpu)

    def refresh_all(self) -> None:
        """Re-derive every GPU's routability (health, ejection, slow start) and refill
        free slots from the queue. O(GPUs); runs on a timer and on health changes."""
        self._recount()
        for gpu in self.view.gpus:
            if gpu.ejected:
                self.outlier.is_ejected(gpu.name)  # un-ejects (via the callback) when time is up
            if gpu.healthy and gpu.healthy_since > gpu.last_seen_healthy:
                self.slow_start.start(gpu.name)  # recovered: ramp its share up again
                gpu.last_seen_healthy = gpu.healthy_since
            gpu.share = self.slow_start.factor(gpu.name)
            self.view.refresh(gpu)
            self._hand_off(gpu)
        self._fail_unservable()

    def _fail_unservable(self) -> None:
        """Queued requests for a model no usable GPU serves any more (down, ejected,
        drained) fail now with UNAVAILABLE, so the tier above can fail them over,
        instead of waiting out their deadline."""
        for key in self.queue.waiting_models() if len(self.queue) else ():
            model, version = split_key(key)
            if not any(g.usable for g in self.view.serving(model, version)):
                self.queue.fail_model(key, self.children.nothing_healthy(model, ()))
