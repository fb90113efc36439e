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
outlier ejection (a per-try timeout counts as a failure). An ejected or
unhealthy GPU leaves the free pools; a recovered one comes back through slow
start. Each lease carries the attempt's expected service time
(``local_lb.cost.attempt_expected_s``), from which the forwarding loop derives
its per-try timeout.

The parts it composes, each in its own module: ``SlotLedger`` (slots),
``QueueHandOff`` (the central queue and late binding), ``RateLearner`` (EWMAs),
``GpuResilience`` (ejection, breaker, slow start), ``GpuReadiness`` (health
verdicts, slow probes, panic) and ``UtilisationBands`` (publication when
utilisation crosses a band).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from common.basics.errors import RouteError
from common.basics.vocabulary import ANONYMOUS_TENANT
from common.request.balancer import Lease, Outcome
from common.request.children import Child, ChildSet
from common.request.pick import Picker, PickRequest
from common.request.prefix import BLOCK_TOKENS
from common.request.resilience import CircuitBreaker, OutlierConfig, SlowStartConfig
from local_lb.cost import (
    attempt_expected_s,
    drain_rps,
    gpu_completion_s,
    outstanding_work,
    request_work,
    sharing,
)
from local_lb.handoff import QueueHandOff
from local_lb.learning import RateLearner, served_work
from local_lb.publication import UtilisationBands
from local_lb.queue import CentralQueue
from local_lb.queue_entries import QueueFull, QueueRejected, QueueTimeout, QueueUnserved, queue_key
from local_lb.readiness import GpuReadiness, ReadinessRules, connection_ready
from local_lb.resilience import GpuResilience
from local_lb.slots import SlotLedger
from local_lb.state import MATCH_MEMO_LIMIT, GpuChild, LocalView
from local_lb.tenancy import TenantHeadroom


def _nothing() -> None:
    return None


@dataclass
class LocalBalancer:
    """Slots, central queue, learning and ejection around a local picker.

    ``picker_factory`` builds the picker over ``view``, again whenever ``set_gpus``
    changes the GPU set (a picker may build structures over the set, such as the
    session ring). ``on_significant_change`` is called when the zone's utilisation
    crosses a band, so its summary can go out at once.
    """

    view: LocalView
    picker_factory: Callable[[LocalView], Picker]
    children: ChildSet
    outlier_config: OutlierConfig = field(default_factory=OutlierConfig)
    slow_start_config: SlowStartConfig = field(default_factory=SlowStartConfig)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    max_queue_wait_s: float = 30.0
    # Fraction of usable slots a heavy tenant may not take while a light one is
    # active (local_lb.tenancy).
    tenant_headroom: float = 0.0
    # Each tenant's share of the central queue (default 1.0).
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    on_significant_change: Callable[[], None] = _nothing
    # Slow probes, panic threshold (local_lb.readiness); whether a GPU's connection is up.
    readiness_rules: ReadinessRules = field(default_factory=ReadinessRules)
    connected: Callable[[GpuChild], bool] = connection_ready
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.slots = SlotLedger(self.view, UtilisationBands(self.on_significant_change))
        self.rates = RateLearner()
        self.resilience = GpuResilience(
            self.view,
            self.outlier_config,
            self.slow_start_config,
            self.breaker,
            on_ejection=self._ejection_changed,
            clock=self.clock,
        )
        self.hand_off = QueueHandOff(
            view=self.view,
            slots=self.slots,
            children=self.children,
            may_take=self._may_take,
            tenant_weights=self.tenant_weights,
            clock=self.clock,
        )
        self.readiness = GpuReadiness(
            self.view, self.children, self.readiness_rules, self.connected, self.clock
        )
        self.tenants = TenantHeadroom(
            self.tenant_headroom, weight=self.queue.weight, clock=self.clock
        )
        self.picker = self.picker_factory(self.view)
        self.policy_name = type(self.picker).__name__
        self.children.add_listener(self.refresh_all)

    @property
    def queue(self) -> CentralQueue:
        return self.hand_off.queue

    @property
    def free_usable_slots(self) -> int:
        return self.slots.free_usable_slots

    def queue_depths(self) -> dict[str, int]:
        """Live entries of the central queue per priority (for metrics and /api/state)."""
        return self.queue.depth_by_priority()

    def ejected_gpus(self) -> frozenset[str]:
        return self.resilience.ejected_keys()

    def expected_service_s(self, work: float) -> float:
        return self.rates.expected_service_s(work)

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
        tenant = pick.tenant or ANONYMOUS_TENANT
        work = max(1.0, pick.work_tokens)
        self.rates.arrived(work)
        self.tenants.arrived(tenant, work)
        held_back = self.free_usable_slots > 0 and not self._may_take(tenant)
        for gpu in () if held_back else self._candidates(pick, tried, ranking):
            if self.breaker.try_acquire(gpu.name):
                self.slots.reserve(gpu)
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

    def lease_on(self, gpu: GpuChild, pick: PickRequest) -> Lease:
        """Count ``pick`` as running on ``gpu``, chosen by someone else: Envoy fell back
        to it from the GPU this tier chose (``local_lb.ext_proc``). Holds a slot even if
        the GPU is full, as the request is there; released like any lease."""
        self.slots.reserve(gpu)
        lease = self._lease(gpu, pick, breaker=False, tried=(gpu.name,))
        lease.reason = "data plane fallback"
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
                tenant=pick.tenant or ANONYMOUS_TENANT,
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
        return self.view.by_name[name]  # the slot was reserved for us by the hand-off

    def _lease(
        self, gpu: GpuChild, pick: PickRequest, *, breaker: bool, tried: Collection[str]
    ) -> Lease:
        cached = 0
        if pick.prefix_blocks:
            cached = self.view.prefix.matches(pick.prefix_blocks, MATCH_MEMO_LIMIT).get(gpu.name, 0)
            self.view.prefix.record(pick.prefix_blocks, gpu.name)
        work = request_work(pick.prompt_tokens, pick.output_tokens, cached * BLOCK_TOKENS)
        self.view.took(pick.work)
        now = self.clock()
        # What the policy expected, and the per-try basis (both exclude this request).
        reported = self.view.reported_requests(gpu, now)
        ahead = outstanding_work(
            gpu.outstanding_work,
            gpu.outstanding_requests - 1,
            reported,
            gpu.slots,
        )
        shared = sharing(gpu.outstanding_requests - 1, reported, gpu.slots)
        gpu.outstanding_work += work
        tenant = pick.tenant or ANONYMOUS_TENANT
        self.tenants.took(tenant)
        if tried:
            reason = "failover"
        elif cached:
            reason = "prefix"
        elif pick.session:
            # The session's GPU was a candidate, ranked by the same cost as the rest.
            reason = "session"
        else:
            reason = "least expected completion"
        return Lease(
            gpu,
            work,
            now,
            model=pick.model,
            planned_output=pick.output_tokens,
            max_tokens=pick.max_tokens,
            tenant=tenant,
            concurrent=gpu.outstanding_requests,
            holds_breaker=breaker,
            reason=reason,
            estimated_s=gpu_completion_s(gpu, work, shared),
            # The per-try basis plans at the cap: an answer may run to it.
            expected_s=attempt_expected_s(gpu, work + pick.max_tokens - pick.output_tokens, ahead),
            policy=self.policy_name,
            cached_blocks=cached,
        )

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
            self.slots.unreserve(gpu)
            self.hand_off.offer_free_slots(gpu)

    def _learn(self, gpu: GpuChild, lease: Lease, outcome: Outcome) -> None:
        now = self.clock()
        self.view.load.record_trailer(gpu.name, outcome.trailers, now)
        if outcome.code == grpc.StatusCode.OK:
            self.resilience.record_success(gpu.name)
            self.rates.finished_ok(
                gpu, served_work(lease, outcome), outcome.elapsed_s, lease.concurrent
            )
            self.readiness.request_succeeded(gpu)
        elif outcome.child_fault or outcome.timed_out:
            self.resilience.record_failure(gpu.name)
            if outcome.code == grpc.StatusCode.UNAVAILABLE:
                self.readiness.request_failed(gpu, f"UNAVAILABLE: {outcome.detail}")

    def _may_take(self, tenant: str) -> bool:
        """Reserved headroom (local_lb.tenancy): may ``tenant`` take a free slot now?"""
        slots = self.slots
        capacity = self.rates.capacity_work_per_s(slots.usable_slots)
        return self.tenants.may_take(tenant, slots.free_usable_slots, slots.usable_slots, capacity)

    # ------------------------------------------------------------------ state changes

    def _ejection_changed(self, gpu: GpuChild, ejected: bool) -> None:
        """A GPU was ejected or came back (its slow start already begun): its slots
        leave or rejoin the usable totals and the queue is re-bound."""
        self.slots.recount()
        if ejected:
            self.hand_off.fail_unservable()
        self.view.refresh(gpu)
        self.hand_off.offer_free_slots(gpu)

    def refresh_all(self) -> None:
        """Re-derive every GPU's routability (health, ejection, slow start) and refill
        free slots from the queue. O(GPUs); runs on a timer and on health changes
        (first re-deriving health itself: panic may begin or end, evidence age)."""
        self.readiness.settle()
        self.slots.recount()
        for gpu in self.view.gpus:
            self.resilience.refresh(gpu)
            self.view.refresh(gpu)
            self.hand_off.offer_free_slots(gpu)
        self.hand_off.fail_unservable()

    def set_gpus(self, gpus: Sequence[GpuChild]) -> None:
        """The GPU set or a GPU's settings changed (a reload): re-index the view, the
        ejection cap and, if GPUs came or went, the picker; then refresh everything."""
        new_set = {id(g) for g in gpus} != {id(g) for g in self.view.gpus}
        self.view.set_gpus(gpus)
        self.resilience.set_total(len(gpus))
        if new_set:
            self.picker = self.picker_factory(self.view)
        self.refresh_all()

    def forget(self, name: str) -> None:
        """A removed GPU finished its last request: drop it from the resilience state,
        load reports and prefix index, so no timer and no lookup names it later."""
        self.resilience.forget(name)
        self.readiness.forget(name)
        self.view.load.forget(name)
        self.view.prefix.forget(name)
