"""One request's way through a simulated deployment: global → region → zone → GPU.

At each tier the request is placed as the tier's proxy places it: the tier's
balancer reserves a child (``acquire``), the child answers, and the balancer
learns from the ``Outcome`` (``release``) — with the capacity hint the child's
tier puts on every answer, and at the GPU with the engine's load trailer. A
failure with one of the tier's failover codes (``UPPER_TIER_FAILOVER`` above the
local tier, ``LOCAL_FORWARDING_CODES`` at it) is retried on the next child after
Envoy's jittered back-off, at most ``max_attempts`` times per tier, as
``common.request.forwarding.Forwarder`` does. Each attempt has the tier's per-try
timeout (``common.request.per_try.within_per_try``, the limit from the lease's
expected service time, as the forwarder computes it): when it passes, the
attempt below is cancelled — the GPU drops the job (``SimGpu.cancel``) — and
the request fails over with DEADLINE_EXCEEDED. It fires on GPUs that are merely
slower than the local tier's estimate, not only on hung ones. The retry budget
is left out (it binds only when many retries run at once). Network time is not
simulated as waiting: the request's RTT to the region that serves it is added
to the latencies it reports, which is all it changes for a unary request.
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
from common.request.forwarding import UPPER_TIER_FAILOVER
from common.request.per_try import PerTryExpired, within_per_try
from common.request.pick import PickRequest
from common.request.prefix import MAX_CARRIED_BLOCKS
from local_lb.load_book import LOAD_TRAILER
from local_lb.server import LOCAL_FORWARDING_CODES
from sim.deployment import SimDeployment, SimRegion, SimZone
from sim.gpu_model import GpuFailed, GpuRefused, SimGpu, SimJob
from sim.requests import SimRequest

MAX_ATTEMPTS = 3
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

    def __init__(
        self,
        code: grpc.StatusCode,
        detail: str,
        trailers: Trailers = (),
        *,
        timed_out: bool = False,
    ) -> None:
        super().__init__(detail)
        self.code, self.detail, self.trailers = code, detail, trailers
        self.timed_out = timed_out  # a per-try timeout: fails over whatever the code


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
        self._per_try = deployment.topology.liveness.per_try_timeout
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
            region = await self._over(
                self.deployment.global_balancer, pick, served, self._in_region, UPPER_TIER_FAILOVER
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
        pick: PickRequest,
        served: _Served,
        below: Below,
        failover: frozenset[grpc.StatusCode],
    ) -> str:
        """One tier's forwarding loop: acquire, call ``below``, release, fail over."""
        tried: list[str] = []
        error: _TierError | None = None
        try:
            for attempt in range(MAX_ATTEMPTS):
                if attempt:
                    await asyncio.sleep(backoff_delay_s(attempt, self.rng))
                try:
                    lease = await balancer.acquire(pick, tried, None)
                except RouteError as err:
                    if error is not None and err.code == grpc.StatusCode.UNAVAILABLE:
                        raise error from None  # nothing else to try: the last failure stands
                    raise _TierError(err.code, err.message, tuple(err.trailers)) from None
                tried.append(lease.child.name)
                started = self.loop.time()
                try:
                    trailers = await self._attempt(balancer, lease, started, pick, served, below)
                except _TierError as err:
                    if err.code not in failover and not err.timed_out:
                        raise
                    error = err
                    continue
                balancer.release(lease, Outcome(OK, self.loop.time() - started, trailers=trailers))
                return lease.child.name
            assert error is not None
            raise error
        finally:
            # A failure's traceback holds this frame: kept in it once the coroutine is
            # over, the two make a cycle that only the cyclic GC would free.
            error = None

    async def _attempt(
        self,
        balancer: Balancer,
        lease: Lease,
        started: float,
        pick: PickRequest,
        served: _Served,
        below: Below,
    ) -> Trailers:
        """One attempt under the tier's per-try timeout; a failure releases the lease and
        raises ``_TierError`` (a per-try expiry as DEADLINE_EXCEEDED, ``timed_out``)."""
        limit = self._per_try.limit_s(lease.expected_s, lease.work)
        try:
            return await within_per_try(
                below(lease.child.name, pick, served), _never_committed, limit
            )
        except PerTryExpired as exc:
            # Cancelled below (the GPU dropped the job): a failover, whatever the codes.
            code, detail = grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
            elapsed = self.loop.time() - started
            balancer.release(lease, Outcome(code, elapsed, detail=detail, timed_out=True))
            raise _TierError(code, detail, timed_out=True) from None
        except asyncio.CancelledError:  # a per-try timeout above gave up on this attempt
            elapsed = self.loop.time() - started
            balancer.release(lease, Outcome(grpc.StatusCode.CANCELLED, elapsed))
            raise
        except _TierError as err:
            elapsed = self.loop.time() - started
            outcome = Outcome(err.code, elapsed, trailers=err.trailers, detail=err.detail)
            balancer.release(lease, outcome)
            raise

    async def _in_region(self, name: str, pick: PickRequest, served: _Served) -> Trailers:
        region: SimRegion = self.deployment.by_region[name]
        if not region.up:
            raise _TierError(grpc.StatusCode.UNAVAILABLE, f"region {name} is down")
        # The hint is the tier's newest summary when it answers, as the servers set
        # it on their trailers: read before forwarding, it would be a request's whole
        # latency old (seconds under load) and steer the parent by a stale picture.
        try:
            await self._over(region.balancer, pick, served, self._in_zone, UPPER_TIER_FAILOVER)
        except _TierError as err:
            raise _TierError(
                err.code, err.detail, region.publisher.hint_trailers(pick.model)
            ) from None
        return region.publisher.hint_trailers(pick.model)

    async def _in_zone(self, name: str, pick: PickRequest, served: _Served) -> Trailers:
        zone: SimZone = self.deployment.zones[name]
        if not zone.up:
            raise _TierError(grpc.StatusCode.UNAVAILABLE, f"zone {name} is down")
        try:
            gpu = await self._over(
                zone.balancer, pick, served, self._on_gpu, LOCAL_FORWARDING_CODES
            )
        except _TierError as err:
            hint = zone.publisher.hint_trailers(pick.model)  # at answer time, as above
            raise _TierError(err.code, err.detail, hint) from None
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
