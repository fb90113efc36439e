"""One request's way through a simulated deployment: global → region → zone → GPU.

At each tier the request is placed as the tier's proxy places it: the tier's
balancer reserves a child (``acquire``), the child answers, and the balancer
learns from the ``Outcome`` (``release``) — with the capacity hint the child's
tier puts on every answer, and at the GPU with the engine's load trailer. Each
tier forwards by the ``ForwardingPolicy`` its server builds
(``sim.deployment.SimForwarding``), as ``common.request.forwarding.Forwarder``
does: a failure with one of the policy's failover codes is retried on the next
child after Envoy's jittered back-off, at most ``max_attempts`` times; a retry
back to a live child needs room in the tier's retry budget (one per tier
process, as each server's forwarder keeps one); when no attempt is left the
tier answers what ``Attempts.error`` makes of its failures (RESOURCE_EXHAUSTED
when every child shed load, else UNAVAILABLE), which the tier above fails over
on in turn. Each attempt has the policy's per-try timeout
(``common.request.per_try.within_per_try``, the limit from the lease's expected
service time, as the forwarder computes it): when it passes, the attempt below
is cancelled — the GPU drops the job (``SimGpu.cancel``) — and the request fails
over with DEADLINE_EXCEEDED. It fires on GPUs that are merely slower than the
local tier's estimate, not only on hung ones. Network time is not simulated as
waiting: the request's RTT to the region that serves it is added to the
latencies it reports, which is all it changes for a unary request.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from common.basics.backoff import backoff_delay_s
from common.basics.errors import RouteError
from common.basics.geo import GeoPoint, rtt_estimate_ms
from common.request.balancer import Balancer, Lease, Outcome
from common.request.forwarding import Attempts, Failover, ForwardingPolicy, passable
from common.request.per_try import PerTryExpired, within_per_try
from common.request.pick import PickRequest
from common.request.prefix import MAX_CARRIED_BLOCKS
from local_lb.load_book import LOAD_TRAILER
from sim.deployment import SimDeployment, SimForwarding, SimRegion, SimZone
from sim.gpu_model import GpuFailed, GpuRefused, SimGpu, SimJob
from sim.publishing import SimPublisher
from sim.requests import SimRequest

OK = grpc.StatusCode.OK
Trailers = tuple[tuple[str, str], ...]


class Recorder(Protocol):
    """What the flow reports to (``sim.measure.Recorder``)."""

    def served(
        self,
        req: SimRequest,
        *,
        region: str,
        zone: str,
        gpu: str,
        home_region: str,
        rtt_ms: float,
        ttft_s: float,
        e2e_s: float,
        cached_tokens: int,
        attempts: int,
    ) -> None: ...

    def failed(
        self, req: SimRequest, *, code: str, home_region: str, elapsed_s: float, attempts: int
    ) -> None: ...


@dataclass(slots=True)
class _Served:
    """The request's whole prompt blocks going down; what the tiers report back up."""

    blocks: tuple[int, ...] = ()
    zone: str = ""
    gpu: str = ""
    job: SimJob | None = None
    attempts: int = 0


Below = Callable[[str, PickRequest, "_Served"], Awaitable[Trailers]]


def _never_committed() -> bool:
    """A unary answer goes back only once the attempt is over: never committed before."""
    return False


class _TierError(Exception):
    """A tier's answer other than OK, with the trailers it carried."""

    def __init__(self, code: grpc.StatusCode, detail: str, trailers: Trailers = ()) -> None:
        super().__init__(detail)
        self.code, self.detail, self.trailers = code, detail, trailers


def _answer(err: RouteError) -> _TierError:
    """A tier's own refusal, as its answer to the tier above."""
    return _TierError(err.code, err.message, tuple(err.trailers))


def _answer_up(
    err: _TierError, up: bool, tier: str, publisher: SimPublisher, pick: PickRequest
) -> _TierError:
    """What the tier above hears of a failure below this tier, as a server answers: the
    child's trailers less its capacity hint (``passable``: a retry-after stays), and this
    tier's newest hint. From a tier lost meanwhile, UNAVAILABLE and no trailers: its parent
    sees only the connection go, so it marks the tier down at once (no retry budget)."""
    if not up:
        return _TierError(grpc.StatusCode.UNAVAILABLE, f"{tier} was lost")
    return _TierError(
        err.code, err.detail, (*passable(err.trailers), *publisher.hint_trailers(pick.model))
    )


class RequestFlow:
    """Routes ``SimRequest`` through ``deployment`` and tells ``recorder`` how each ended."""

    def __init__(
        self,
        deployment: SimDeployment,
        recorder: Recorder,
        *,
        rtt_ms: Callable[[GeoPoint, GeoPoint], float] = rtt_estimate_ms,
    ) -> None:
        self.deployment = deployment
        self.recorder = recorder
        self.loop = deployment.loop
        self.rng = random.Random(deployment.rng.getrandbits(64))
        self._rtt = rtt_ms
        self._locations = {r.name: r.location for r in deployment.topology.regions}
        self._home: dict[str, str] = {}

    def rtt_to(self, origin: GeoPoint, region: str) -> float:
        return self._rtt(origin, self._locations[region])

    def home_region(self, req: SimRequest) -> str:
        """The region nearest the request's city (cached per city)."""
        home = self._home.get(req.city)
        if home is None:
            home = min(self._locations, key=lambda r: self.rtt_to(req.origin, r))
            self._home[req.city] = home
        return home

    async def serve(self, req: SimRequest) -> None:
        pick = PickRequest(
            req.model,
            "",
            req.origin,
            req.session,
            req.priority,
            req.prompt_tokens,
            req.output_tokens,
            req.tenant,
            # The edge carries only the leading blocks down; the GPU sees the whole prompt.
            prefix_blocks=req.prefix_blocks[:MAX_CARRIED_BLOCKS],
        )
        home = self.home_region(req)
        served = _Served(req.prefix_blocks)
        try:
            deployment = self.deployment
            region = await self._over(
                deployment.global_balancer,
                deployment.global_forwarding,
                pick,
                served,
                self._in_region,
            )
        except _TierError as err:
            self.recorder.failed(
                req,
                code=err.code.name,
                home_region=home,
                elapsed_s=self.loop.time() - req.at_s,
                attempts=served.attempts,
            )
            return
        job = served.job
        assert job is not None
        rtt_s = self.rtt_to(req.origin, region) / 1000.0
        self.recorder.served(
            req,
            region=region,
            zone=served.zone,
            gpu=served.gpu,
            home_region=home,
            rtt_ms=rtt_s * 1000.0,
            ttft_s=job.first_token_at - req.at_s + rtt_s,
            e2e_s=job.finished_at - req.at_s + rtt_s,
            cached_tokens=job.cached_tokens,
            attempts=served.attempts,
        )

    async def _over(
        self,
        balancer: Balancer,
        forwarding: SimForwarding,
        pick: PickRequest,
        served: _Served,
        below: Below,
    ) -> str:
        """One tier's forwarding loop, as ``Forwarder.forward`` runs it: acquire, call
        ``below``, release; fail over on the policy's codes, a retry to a live child
        inside the budget; when none is left, the error ``Attempts.error`` makes."""
        policy, budget = forwarding.policy, forwarding.budget
        attempts = Attempts()
        budget.request_started()
        try:
            while True:
                if attempts.failures:
                    if len(attempts.tried) >= policy.max_attempts:
                        raise _answer(attempts.error(policy.kind, pick.model))
                    if not attempts.failures[-1].child_down:
                        if not budget.try_start_retry():
                            raise _answer(attempts.error(policy.kind, pick.model))
                        attempts.holding_retry = True
                try:
                    name = await self._attempt(balancer, policy, attempts, pick, served, below)
                finally:
                    if attempts.holding_retry:
                        attempts.holding_retry = False
                        budget.retry_finished()
                if name is not None:
                    return name
        finally:
            budget.request_finished()

    async def _attempt(
        self,
        balancer: Balancer,
        policy: ForwardingPolicy,
        attempts: Attempts,
        pick: PickRequest,
        served: _Served,
        below: Below,
    ) -> str | None:
        """One attempt (after its back-off when it is not the first) under the tier's
        per-try timeout: the child that answered OK, or None when the request fails over
        (the failure kept in ``attempts``). A failure that does not fail over raises
        ``_TierError``; every lease is released."""
        if attempts.tried:
            await asyncio.sleep(backoff_delay_s(len(attempts.tried), self.rng))
        try:
            lease = await balancer.acquire(pick, attempts.tried, None)
        except RouteError as err:
            if attempts.tried and err.code == grpc.StatusCode.UNAVAILABLE:
                raise _answer(attempts.error(policy.kind, pick.model)) from None
            raise _answer(err) from None
        attempts.tried.append(lease.child.name)
        started = self.loop.time()
        limit = policy.per_try.limit_s(lease.expected_s, lease.work)
        try:
            trailers = await within_per_try(
                below(lease.child.name, pick, served), _never_committed, limit
            )
        except PerTryExpired as exc:
            # Cancelled below (the GPU dropped the job): a failover, whatever the codes.
            failure = _TierError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            self._fail_over(balancer, lease, started, attempts, failure, timed_out=True)
            return None
        except asyncio.CancelledError:  # a per-try timeout above gave up on this attempt
            balancer.release(lease, Outcome(grpc.StatusCode.CANCELLED, self.loop.time() - started))
            raise
        except _TierError as err:
            if err.code in policy.failover_codes:
                self._fail_over(balancer, lease, started, attempts, err)
                return None
            elapsed = self.loop.time() - started
            outcome = Outcome(err.code, elapsed, trailers=err.trailers, detail=err.detail)
            balancer.release(lease, outcome)
            raise
        balancer.release(lease, Outcome(OK, self.loop.time() - started, trailers=trailers))
        return lease.child.name

    def _fail_over(
        self,
        balancer: Balancer,
        lease: Lease,
        started: float,
        attempts: Attempts,
        failure: _TierError,
        *,
        timed_out: bool = False,
    ) -> None:
        """Settle an attempt that fails over (``Forwarder._expired``, ``_failed``): the
        lease released, then the failure kept with whether that left the child down."""
        code, detail, trailers = failure.code, failure.detail, failure.trailers
        elapsed = self.loop.time() - started
        outcome = Outcome(code, elapsed, trailers=trailers, detail=detail, timed_out=timed_out)
        balancer.release(lease, outcome)
        down = not lease.child.healthy
        attempts.failures.append(
            Failover(lease.child.name, code, detail, trailers, child_down=down)
        )

    async def _in_region(self, name: str, pick: PickRequest, served: _Served) -> Trailers:
        region: SimRegion = self.deployment.by_region[name]
        if not region.up:
            raise _TierError(grpc.StatusCode.UNAVAILABLE, f"region {name} is down")
        # The hint is the tier's newest summary when it answers, as the servers set
        # it on their trailers: read before forwarding, it would be a request's whole
        # latency old (seconds under load) and steer the parent by a stale picture.
        try:
            await self._over(region.balancer, region.forwarding, pick, served, self._in_zone)
        except _TierError as err:
            raise _answer_up(err, region.up, f"region {name}", region.publisher, pick) from None
        return region.publisher.hint_trailers(pick.model)

    async def _in_zone(self, name: str, pick: PickRequest, served: _Served) -> Trailers:
        zone: SimZone = self.deployment.zones[name]
        if not zone.up:
            raise _TierError(grpc.StatusCode.UNAVAILABLE, f"zone {name} is down")
        try:
            gpu = await self._over(zone.balancer, zone.forwarding, pick, served, self._on_gpu)
        except _TierError as err:
            raise _answer_up(err, zone.up, f"zone {name}", zone.publisher, pick) from None
        served.zone, served.gpu = name, gpu
        return zone.publisher.hint_trailers(pick.model)

    async def _on_gpu(self, name: str, pick: PickRequest, served: _Served) -> Trailers:
        served.attempts += 1
        zone = self.deployment.zones_by_gpu[name]
        gpu: SimGpu = zone.gpus[name]
        try:
            job = gpu.submit(pick.prompt_tokens, pick.max_tokens, served.blocks)
        except GpuFailed as exc:
            raise _TierError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except GpuRefused as exc:
            raise _TierError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        # A failed or cancelled future keeps its error, whose traceback holds this
        # frame: on those paths the frame lets go of the job (and so of the future),
        # or the two would make a cycle that only the cyclic GC frees.
        try:
            await job.done
        except asyncio.CancelledError:  # the per-try timeout cancelled the call
            gpu.cancel(job)
            del job
            raise
        except GpuFailed as exc:
            del job
            raise _TierError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        served.job = job
        load = f"running={gpu.running},waiting={len(gpu.waiting)},kv={gpu.kv_cache_usage:.3f}"
        return ((LOAD_TRAILER, load),)
