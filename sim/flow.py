"""One request's way through a simulated deployment: global → region → zone → GPU.

Each tier forwards with the servers' own loop: the ``Forwarder`` its process
holds (``sim.deployment.tier_forwarder``: the tier's ``ForwardingPolicy``,
balancer and retry budget on the simulated clock). What this module adds is the
wire: the ``Attempt`` the forwarder sends (``_ToRegion``, ``_ToZone``,
``_ToGpu``) runs the tier below in simulated time and hands back its trailers,
or raises ``grpc.aio.AioRpcError`` with its status and trailers as a channel
would. So
acquire and release, failover on the policy's codes after Envoy's jittered
back-off, the retry budget (a retry back to a live child needs room in it), the
per-try timeout (``common.request.per_try``, from the lease's expected service
time) and the status once no attempt is left (``Attempts.error``) are the
servers' code, not a copy of it.

A tier answers as its server does: on success the child's trailers with its
route and its own newest capacity hint (read when it answers: read before
forwarding, it would be a request's whole latency old); on failure the status
with the trailers the loop kept (``passable``: a retry-after stays, the child's
hint goes) and its own hint. A tier lost under a request answers UNAVAILABLE with
no trailers, whatever failed below it: its parent sees only the connection go,
so it marks the tier down at once (no retry budget). When a per-try timeout
passes, the attempt below is cancelled down to the GPU, which drops the job
(``SimGpu.cancel``): it fires on GPUs that are merely slower than the local
tier's estimate, not only on hung ones.

Network time is not simulated as waiting: the request's RTT to the region that
serves it is added to the latencies it reports, which is all it changes for a
unary request. Nothing travels in metadata either: the request goes down as its
``PickRequest`` (the edge's prefix blocks only; the true answer length is the
GPU's alone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint, rtt_estimate_ms
from common.request.attempt import Metadata
from common.request.children import Child
from common.request.pick import PickRequest
from common.request.prefix import MAX_CARRIED_BLOCKS
from local_lb.load_book import LOAD_TRAILER
from sim.deployment import SimDeployment, SimRegion, SimZone
from sim.gpu_model import GpuFailed, GpuRefused, SimGpu, SimJob
from sim.requests import SimRequest

Trailers = tuple[tuple[str, str], ...]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
# Never written to: every error answer's initial metadata, and a lost tier's trailers.
_NONE = grpc.aio.Metadata()


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
    output_tokens: int = 0  # the answer's true length: the GPU's to know, no tier's
    region: str = ""
    zone: str = ""
    gpu: str = ""
    job: SimJob | None = None
    attempts: int = 0


class _NoMetadata:
    """The hints the forwarder sends down (``Downstream``): none, the tier below gets
    the ``PickRequest`` itself, so no metadata is built for an attempt."""

    attempt: int = 0

    def downstream_metadata(
        self, origin: GeoPoint | None, attempt: int, prefix_blocks: tuple[int, ...] = ()
    ) -> Metadata:
        return []


_DOWN = _NoMetadata()


class _Call:
    """A unary call to the tier below (``Attempt``), served in simulated time: its
    ``send`` answers with the tier's trailers or raises ``grpc.aio.AioRpcError``, as a
    channel does. Nothing goes back to the caller before it ends: never committed."""

    method: str = "ModelInfer"
    committed: bool = False

    def __init__(self, deployment: SimDeployment, pick: PickRequest, served: _Served) -> None:
        self.deployment = deployment
        self.pick = pick
        self.served = served

    @property
    def reported_completion(self) -> int | None:
        """The answer's length, as the GPU's server reports it once the job is done."""
        job = self.served.job
        return None if job is None else job.output_tokens


class _ToRegion(_Call):
    """The global tier's call to a regional tier, which forwards to a zone."""

    async def send(
        self, child: Child, metadata: Metadata, timeout: float | None
    ) -> tuple[None, Trailers]:
        name = child.name
        region = self.deployment.by_region[name]
        below = _ToZone(self.deployment, self.pick, self.served)
        trailers = await _forward_in(region, f"region {name}", below)
        self.served.region = name
        return None, trailers


class _ToZone(_Call):
    """A regional tier's call to a local tier, which forwards to a GPU."""

    async def send(
        self, child: Child, metadata: Metadata, timeout: float | None
    ) -> tuple[None, Trailers]:
        name = child.name
        zone = self.deployment.zones[name]
        below = _ToGpu(self.deployment, self.pick, self.served)
        trailers = await _forward_in(zone, f"zone {name}", below)
        self.served.zone = name
        return None, trailers


async def _forward_in(tier: SimRegion | SimZone, what: str, below: _ToZone | _ToGpu) -> Trailers:
    """A regional or local tier's server taking a call: UNAVAILABLE when it is down, else
    its forwarder's answer, a refusal going up as its server aborts (``_answer_up``)."""
    if not tier.up:
        raise _error(UNAVAILABLE, f"{what} is down")
    pick = below.pick
    try:
        _, _, trailers = await tier.forwarding.forward(below, pick, _DOWN, None)
    except RouteError as err:
        hint = tier.publisher.hint_trailers(pick.model)
        raise _answer_up(err, tier.up, what, hint) from None
    return trailers


class _ToGpu(_Call):
    """A local tier's call to a GPU's inference server, which runs the job."""

    async def send(
        self, child: Child, metadata: Metadata, timeout: float | None
    ) -> tuple[None, Trailers]:
        name, pick, served = child.name, self.pick, self.served
        served.attempts += 1
        gpu: SimGpu = self.deployment.zones_by_gpu[name].gpus[name]
        try:
            job = gpu.submit(
                pick.prompt_tokens, pick.max_tokens, served.blocks, served.output_tokens
            )
        # One name per clause: compiled, a name keeps the type of the first that binds it.
        except GpuFailed as failed:
            raise _error(UNAVAILABLE, str(failed)) from None
        except GpuRefused as refused:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT, str(refused)) from None
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
            raise _error(UNAVAILABLE, str(exc)) from None
        served.job, served.gpu = job, name
        load = f"running={gpu.running},waiting={len(gpu.waiting)},kv={gpu.kv_cache_usage:.3f}"
        return None, ((LOAD_TRAILER, load),)


def _error(code: grpc.StatusCode, detail: str, trailers: Trailers = ()) -> grpc.aio.AioRpcError:
    """A tier's answer other than OK, as its caller's channel raises it."""
    return grpc.aio.AioRpcError(code, _NONE, grpc.aio.Metadata(*trailers), detail)


def _answer_up(err: RouteError, up: bool, tier: str, hint: Trailers) -> grpc.aio.AioRpcError:
    """A tier's refusal as its server aborts the call: the loop's trailers and this
    tier's newest capacity ``hint``. From a tier lost meanwhile, UNAVAILABLE and no
    trailers."""
    if not up:
        return grpc.aio.AioRpcError(UNAVAILABLE, _NONE, _NONE, f"{tier} was lost")
    return _error(err.code, err.message, (*err.trailers, *hint))


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
        forwarding = self.deployment.global_forwarding
        pick = PickRequest(
            req.model,
            "",
            req.origin,
            req.session,
            req.priority,
            req.prompt_tokens,
            # The client's cap: the answer's true length is the GPU's alone to know.
            req.max_tokens,
            req.tenant,
            # The edge carries only the leading blocks down; the GPU sees the whole prompt.
            prefix_blocks=req.prefix_blocks[:MAX_CARRIED_BLOCKS],
            # Planned at the edge from the answers it has seen; the inner tiers, which
            # see the same answers pass, take the edge's plan rather than each
            # building a request of its own.
            planned_output=forwarding.outputs.planned(req.model, req.max_tokens),
        )
        home = self.home_region(req)
        served = _Served(req.prefix_blocks, req.output_tokens)
        call = _ToRegion(self.deployment, pick, served)
        try:
            await forwarding.forward(call, pick, _DOWN, None)
        except RouteError as err:
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
        region = served.region
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
