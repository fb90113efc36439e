"""What each GPU reports about its own load and health, with the age of every sample.

Two sources feed one ``LoadBook``: a ``BackendMonitor`` scrapes each GPU's
Prometheus endpoint on an interval (vLLM or Triton metric names), and the
proxy records the ``x-meridian-load`` trailer the GPU puts on every response.
The book keeps the newest sample per GPU; a sample older than the caller's
``max_age_s`` reads as unknown (``None``), never as an idle GPU.

The monitor also checks each GPU's health (grpc.health.v1 plus V2 ModelReady)
and hands every result to a callback; the caller decides what a transition
means. Parsing is in small pure functions, I/O only in the monitor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.basics.tasks import cancel_and_wait
from common.config.topology import GpuConfig
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import CHANNEL_OPTIONS, V2_SERVICE

log = logging.getLogger(__name__)

Clock = Callable[[], float]
HealthCallback = Callable[[str, bool, str], None]
Load = tuple[float, float, float | None]

LOAD_TRAILER = "x-meridian-load"
JITTER = 0.1  # polls are spread over interval * [0.9, 1.1] so GPUs are not polled in step

_RUNNING = ("vllm:num_requests_running",)
# vLLM first; Triton's queued-for-execution count means the same thing.
_WAITING = ("vllm:num_requests_waiting", "nv_inference_pending_request_count")
# The current vLLM name first, then the one it replaced.
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_KNOWN = frozenset(_RUNNING + _WAITING + _KV)

# One sample line of the text exposition format: name, optional labels (quoted
# values may hold commas, spaces, braces and escaped quotes), value, optional
# timestamp. Every repetition ends in a distinct character, so matching is linear.
_LABEL = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\]|\\.)*"'
_SAMPLE = re.compile(
    rf"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:\{{(?:{_LABEL}\s*,)*(?:{_LABEL})?\s*\}})?"
    r"[ \t]+(?P<value>\S+)(?:[ \t]+-?\d+)?"
)


@dataclass(frozen=True)
class LoadSample:
    """One GPU's load as it reported it, and when this process received it."""

    running: float
    waiting: float
    kv_cache_usage: float | None  # 0..1 of the KV cache; None when the server does not say
    taken_at: float  # this process's monotonic clock
    source: str  # "metrics" or "trailer"

    def age(self, now: float) -> float:
        return now - self.taken_at


def parse_prometheus_load(text: str) -> Load | None:
    """``(running, waiting, kv_cache_usage)`` from a Prometheus text exposition.

    Counts are summed over all label sets (one series per model). KV usage is
    a fraction of the one cache the models share (the emulated GPU repeats the
    same GPU-wide figure on every model's series), so it takes the largest
    series, never a sum. Triton's pending count is read as waiting when no vLLM
    waiting gauge is present; Triton has no running gauge, so running is 0.
    Comments, unknown metrics, malformed lines and non-finite or negative
    values are skipped. ``None`` when no known metric is present.
    """
    sums: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(("vllm:", "nv_inference_pending_request_count")):
            continue  # comments, HELP/TYPE and other metrics, without a regex
        match = _SAMPLE.fullmatch(line)
        if match is None or match["name"] not in _KNOWN:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        name = match["name"]
        if name in _KV:
            sums[name] = max(sums.get(name, 0.0), value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    if not sums:
        return None
    running = next((sums[n] for n in _RUNNING if n in sums), 0.0)
    waiting = next((sums[n] for n in _WAITING if n in sums), 0.0)
    kv = next((sums[n] for n in _KV if n in sums), None)
    return running, waiting, kv


def parse_load_trailer(value: str) -> tuple[float, float, float] | None:
    """``(running, waiting, kv)`` from ``running=3,waiting=1,kv=0.250``; ``None`` if malformed.

    All three keys are required, once each, with finite non-negative values;
    unknown keys are ignored so the GPU side can add fields.
    """
    fields: dict[str, float] = {}
    for part in value.split(","):
        key, sep, text = part.strip().partition("=")
        if not sep or not key:
            return None
        try:
            number = float(text)
        except ValueError:
            return None
        if key in fields or not math.isfinite(number) or number < 0:
            return None
        fields[key] = number
    try:
        return fields["running"], fields["waiting"], fields["kv"]
    except KeyError:
        return None


class LoadBook:
    """The newest load sample of each GPU, from whichever source reported last.

    Reads take the caller's ``now`` and ``max_age_s``: a sample older than
    that is unknown (``None``), never read as an idle GPU with zero load.
    """

    def __init__(self) -> None:
        self._samples: dict[str, LoadSample] = {}

    def update(self, name: str, sample: LoadSample) -> None:
        """Keep ``sample`` unless the book already holds a newer one for ``name``."""
        current = self._samples.get(name)
        if current is None or sample.taken_at >= current.taken_at:
            self._samples[name] = sample

    def get(self, name: str, now: float, max_age_s: float) -> LoadSample | None:
        """The newest sample if at most ``max_age_s`` old, else ``None`` (unknown)."""
        sample = self._samples.get(name)
        if sample is None or sample.age(now) > max_age_s:
            return None
        return sample

    def forget(self, name: str) -> None:
        """Drop a GPU that left the zone."""
        self._samples.pop(name, None)

    def conservative_waiting(
        self, name: str, now: float, max_age_s: float, fallback: float
    ) -> float:
        """The GPU's reported queue length if fresh, else ``fallback``.

        A missing or stale sample is never read as an empty queue: the caller
        passes something pessimistic (its own in-flight count, or a penalty).
        """
        sample = self.get(name, now, max_age_s)
        return fallback if sample is None else sample.waiting

    def record_trailer(
        self, name: str, trailers: Iterable[tuple[str, str | bytes]] | None, now: float
    ) -> LoadSample | None:
        """Record the ``x-meridian-load`` trailer of a response from ``name``, if well-formed."""
        for key, value in trailers or ():
            if key.lower() != LOAD_TRAILER:
                continue
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            parsed = parse_load_trailer(text)
            if parsed is None:
                return None
            sample = LoadSample(*parsed, taken_at=now, source="trailer")
            self.update(name, sample)
            return sample
        return None


@dataclass(frozen=True)
class MonitoredGpu:
    """What the monitor needs of one GPU. ``metrics_url`` None: no scrape, health only."""

    name: str
    address: str  # host:port of its V2 gRPC server
    models: frozenset[str]
    metrics_url: str | None = None

    @classmethod
    def from_config(cls, gpu: GpuConfig) -> MonitoredGpu:
        return cls(
            name=gpu.name,
            address=gpu.endpoint.address,
            models=frozenset(gpu.models),
            metrics_url=f"http://{gpu.metrics_endpoint.address}/metrics",
        )


def jittered(interval_s: float, rng: random.Random) -> float:
    """The delay to the next poll: ``interval_s`` spread by ±``JITTER``."""
    return interval_s * rng.uniform(1 - JITTER, 1 + JITTER)


@dataclass(eq=False)
class _Backend:
    gpu: MonitoredGpu
    health: health_pb2_grpc.HealthStub
    v2: pb_grpc.GRPCInferenceServiceStub
    ready_models: frozenset[str] = frozenset()
    metrics_ok: bool | None = None  # None until the first scrape


class BackendMonitor:
    """Polls every GPU's metrics and health on a jittered interval; one task per GPU.

    Each poll scrapes ``/metrics`` into the ``LoadBook`` and checks health:
    grpc.health.v1 ``Check`` for the V2 service (the server-wide ``""`` when
    the server does not know that name), then ``ModelReady`` for each model.
    A GPU is healthy only if SERVING with at least one model ready;
    ``on_health(name, healthy, reason)`` is called after every check.

    Failure modes: a failed scrape never marks a GPU unhealthy (a server may
    have no metrics port); its sample just goes stale. A black-holed GPU costs
    one ``timeout_s`` per poll, never more. Caches only the ready models of
    the last check, for ``ready_models``. The session, channels and tasks are
    created in ``start()`` and released in reverse order in ``stop()``.
    """

    def __init__(
        self,
        gpus: Iterable[MonitoredGpu],
        *,
        on_health: HealthCallback,
        book: LoadBook | None = None,
        interval_s: float = 0.5,
        timeout_s: float | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.gpus = tuple(gpus)
        names = [g.name for g in self.gpus]
        if len(set(names)) != len(names):
            raise ValueError(f"GPU names must be unique, got {names}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.timeout_s = interval_s if timeout_s is None else timeout_s
        if not 0 < self.timeout_s <= interval_s:
            raise ValueError(f"timeout_s must be in (0, interval_s={interval_s}], got {timeout_s}")
        self.interval_s = interval_s
        self.book = book if book is not None else LoadBook()
        self._on_health = on_health
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._backends: dict[str, _Backend] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    def watched(self, name: str) -> MonitoredGpu | None:
        """What the monitor checks of GPU ``name`` (None: not monitored)."""
        backend = self._backends.get(name)
        return None if backend is None else backend.gpu

    def ready_models(self, name: str) -> frozenset[str]:
        """Models that answered ModelReady at ``name``'s last check (empty if unhealthy)."""
        backend = self._backends.get(name)
        return frozenset() if backend is None else backend.ready_models

    async def start(self) -> None:
        if self._stack is not None:
            raise RuntimeError("BackendMonitor already started")
        async with contextlib.AsyncExitStack() as stack:
            self._session = aiohttp.ClientSession()
            stack.push_async_callback(self._session.close)
            stack.push_async_callback(self._close_backends)
            for gpu in self.gpus:
                self._open(gpu)
            self._stack = stack.pop_all()

    def _open(self, gpu: MonitoredGpu) -> None:
        assert self._session is not None
        channel = grpc.aio.insecure_channel(gpu.address, options=CHANNEL_OPTIONS)
        self._channels[gpu.name] = channel
        backend = _Backend(
            gpu, health_pb2_grpc.HealthStub(channel), pb_grpc.GRPCInferenceServiceStub(channel)
        )
        self._backends[gpu.name] = backend
        self._tasks[gpu.name] = asyncio.create_task(
            self._poll_loop(backend, self._session), name=f"load-poll:{gpu.name}"
        )

    async def _close_backends(self) -> None:
        await cancel_and_wait(self._tasks.values())
        for channel in self._channels.values():
            await channel.close()

    def add(self, gpu: MonitoredGpu) -> None:
        """Start watching a GPU added by a reloaded topology (after ``start()``)."""
        if gpu.name in self._backends:
            raise ValueError(f"GPU {gpu.name!r} is already monitored")
        self.gpus = (*self.gpus, gpu)
        self._open(gpu)

    async def remove(self, name: str) -> None:
        """Stop watching a GPU a reloaded topology removed; no callback follows."""
        task = self._tasks.pop(name, None)
        if task is not None:
            await cancel_and_wait([task])
        channel = self._channels.pop(name, None)
        if channel is not None:
            await channel.close()
        self._backends.pop(name, None)
        self.gpus = tuple(g for g in self.gpus if g.name != name)

    async def update(self, gpu: MonitoredGpu) -> None:
        """A kept GPU whose settings a reloaded topology changed: the next poll checks
        the new models and scrapes the new metrics URL; a new address re-opens its
        channel (and restarts its poll)."""
        backend = self._backends.get(gpu.name)
        if backend is None:
            raise ValueError(f"GPU {gpu.name!r} is not monitored")
        if backend.gpu == gpu:
            return
        if backend.gpu.address != gpu.address:
            await self.remove(gpu.name)
            self.add(gpu)
            return
        backend.gpu = gpu
        backend.metrics_ok = None
        self.gpus = tuple(gpu if g.name == gpu.name else g for g in self.gpus)

    async def stop(self) -> None:
        """Cancel the polls, then close the channels and the HTTP session."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def _poll_loop(self, backend: _Backend, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            # Both within one timeout_s; a bug is logged, never ends this GPU's loop.
            await asyncio.gather(
                _logged(self._scrape(backend, session), backend.gpu.name),
                _logged(self._check(backend), backend.gpu.name),
            )
            elapsed = loop.time() - started
            await asyncio.sleep(max(0.0, jittered(self.interval_s, self._rng) - elapsed))

    async def _scrape(self, backend: _Backend, session: aiohttp.ClientSession) -> None:
        url = backend.gpu.metrics_url
        if url is None:
            return
        error = ""
        load: Load | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with session.get(url, timeout=timeout) as response:
                if response.status != 200:
                    error = f"HTTP {response.status}"
                else:
                    load = parse_prometheus_load((await response.read()).decode("utf-8", "replace"))
                    error = "" if load is not None else "no known load metric in the response"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        name = backend.gpu.name
        if load is None:
            if backend.metrics_ok is not False:
                log.warning(
                    "metrics of GPU %s unusable at %s (%s); its load goes stale", name, url, error
                )
            backend.metrics_ok = False
            return
        self.book.update(name, LoadSample(*load, taken_at=self._clock(), source="metrics"))
        if backend.metrics_ok is False:
            log.info("metrics of GPU %s usable again", name)
        backend.metrics_ok = True

    async def _check(self, backend: _Backend) -> None:
        healthy, reason, ready = await self._probe(backend)
        backend.ready_models = ready
        self._on_health(backend.gpu.name, healthy, reason)

    async def _probe(self, backend: _Backend) -> tuple[bool, str, frozenset[str]]:
        """``(healthy, reason, ready models)``, all within one ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s

        def remaining() -> float:
            return max(0.0, deadline - loop.time())

        serving = health_pb2.HealthCheckResponse.SERVING
        try:
            try:
                reply = await backend.health.Check(
                    health_pb2.HealthCheckRequest(service=V2_SERVICE), timeout=remaining()
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                reply = await backend.health.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=remaining()
                )
        except grpc.aio.AioRpcError as exc:
            return False, f"health check: {exc.code().name}: {exc.details()}", frozenset()
        if reply.status != serving:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return False, f"health check: {status}", frozenset()

        async def model_ready(model: str) -> str | None:
            """None when ready, else why not."""
            try:
                answer = await backend.v2.ModelReady(
                    pb.ModelReadyRequest(name=model), timeout=remaining()
                )
            except grpc.aio.AioRpcError as exc:
                return f"{model}: {exc.code().name}"
            return None if answer.ready else f"{model}: not ready"

        models = sorted(backend.gpu.models)
        errors = await asyncio.gather(*(model_ready(m) for m in models))
        ready = frozenset(m for m, err in zip(models, errors, strict=True) if err is None)
        if not ready:
            why = "; ".join(e for e in errors if e) or "no models configured"
            return False, f"SERVING but no model ready ({why})", ready
        return True, f"SERVING, {len(ready)}/{len(models)} models ready", ready


async def _logged(step: Awaitable[None], name: str) -> None:
    try:
        await step
    except Exception:
        log.exception("load monitor poll of GPU %s failed", name)
