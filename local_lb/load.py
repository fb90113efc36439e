"""The local tier's monitor of its GPUs: load from their metrics, and their health.

A ``BackendMonitor`` polls every GPU on a jittered interval: it scrapes the
GPU's Prometheus endpoint into the ``LoadBook`` (``local_lb.load_book``, which
the proxy also feeds from the ``x-meridian-load`` trailer) and checks its
health through ``common.request.health.HealthChecker`` (grpc.health.v1 plus V2
ModelReady; V2 ServerReady instead for a GPU without grpc.health.v1; for a GPU that
speaks OpenAI HTTP, ``local_lb.openai_probe``'s ``/health`` and ``/v1/models``), handing
every ``GpuCheck`` to a callback; the caller decides what it means
(``local_lb.readiness``: a check that timed out is slowness, not a verdict). Its
channels run the GPU keepalive, like the ones requests take.

Passive evidence stands in for a poll: a GPU on which a request succeeded within the
interval (``up_at``, the caller's record) is not checked this round, and a GPU whose
own load report (the trailer) is younger than the interval is not scraped; a GPU with
no such evidence (an idle one) is polled as before. So no GPU goes longer than about
one interval (x 1.1, the jitter) without either a success or a check, as when every
GPU was checked every round; what a success cannot show (another model's readiness,
say) is still checked at least every ``CHECK_AT_LEAST_EVERY`` intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import grpc

from common.basics.tasks import cancel_and_wait
from common.config.gpu import GpuConfig
from common.config.liveness import STOCK_SERVER_KEEPALIVE, Keepalive
from common.request.health import GpuCheck, HealthChecker
from common.request.server import channel_options, dial
from local_lb.load_book import (
    Load,
    LoadBook,
    LoadSample,
    parse_prometheus_load,
)
from local_lb.openai_probe import OpenAIHealth

log = logging.getLogger(__name__)

Clock = Callable[[], float]
HealthCallback = Callable[[str, GpuCheck], None]

JITTER = 0.1  # polls are spread over interval * [0.9, 1.1] so GPUs are not polled in step
# A GPU serving traffic is still checked actively at least this many intervals apart.
CHECK_AT_LEAST_EVERY = 10


def no_evidence(name: str) -> float:
    """An ``up_at`` that knows of no success: every GPU is checked every round."""
    return float("-inf")


@dataclass(frozen=True)
class MonitoredGpu:
    """What the monitor needs of one GPU. ``metrics_url`` None: no scrape, health only."""

    name: str
    address: str  # host:port of its V2 gRPC server
    models: frozenset[str]
    metrics_url: str | None = None
    # TLS towards a GPU whose entry says ``tls`` (None: plaintext); taken when its
    # channel opens, so not part of what a reload compares.
    credentials: grpc.ChannelCredentials | None = field(default=None, compare=False)
    # "v2": health over gRPC; "openai": over HTTP (no channel is opened).
    protocol: str = "v2"

    @classmethod
    def from_config(
        cls, gpu: GpuConfig, credentials: grpc.ChannelCredentials | None = None
    ) -> MonitoredGpu:
        return cls(
            name=gpu.name,
            address=gpu.endpoint.address,
            models=frozenset(gpu.models),
            metrics_url=f"http://{gpu.metrics_endpoint.address}/metrics",
            credentials=credentials,
            protocol=gpu.protocol,
        )


class GpuProbe(Protocol):
    """One GPU's health check, whatever protocol it speaks (``HealthChecker``,
    ``OpenAIHealth``)."""

    async def check_gpu(self, models: Iterable[str], timeout_s: float) -> GpuCheck: ...


def jittered(interval_s: float, rng: random.Random) -> float:
    """The delay to the next poll: ``interval_s`` spread by ±``JITTER``."""
    return interval_s * rng.uniform(1 - JITTER, 1 + JITTER)


@dataclass(eq=False)
class _Backend:
    gpu: MonitoredGpu
    health: GpuProbe
    ready_models: frozenset[str] = frozenset()
    metrics_ok: bool | None = None  # None until the first scrape
    # When the next scrape and check are due, and when the last check began (monitor clock).
    scrape_due: float = float("-inf")
    check_due: float = float("-inf")
    checked_at: float = float("-inf")
    # Polls that passive evidence stood in for (what an operator or a test can read).
    skipped_checks: int = 0
    skipped_scrapes: int = 0


class BackendMonitor:
    """Polls every GPU's metrics and health on a jittered interval; one task per GPU.

    Each poll scrapes ``/metrics`` into the ``LoadBook`` and checks health:
    grpc.health.v1 ``Check`` for the V2 service (the server-wide ``""`` when
    the server does not know that name), then ``ModelReady`` for each model.
    A GPU is healthy only if SERVING with at least one model ready;
    ``on_health(name, check)`` is called after every check. ``up_at(name)`` is when
    a request last succeeded on it (``GpuReadiness.up_at``, on this monitor's clock):
    a success younger than the interval stands in for this round's check (see the
    module docstring), a load trailer in the book younger than it for the scrape.

    Failure modes: a failed scrape never marks a GPU unhealthy (a server may
    have no metrics port); its sample just goes stale. A black-holed GPU costs
    one ``timeout_s`` per poll, never more. Caches only the ready models of
    the last check that was not slow, for ``ready_models``. The session,
    channels and tasks are created in ``start()`` and released in reverse order
    in ``stop()``.
    """

    def __init__(
        self,
        gpus: Iterable[MonitoredGpu],
        *,
        on_health: HealthCallback,
        up_at: Callable[[str], float] = no_evidence,
        book: LoadBook | None = None,
        interval_s: float = 0.5,
        timeout_s: float | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        keepalive: Keepalive = STOCK_SERVER_KEEPALIVE,
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
        self._channel_options = channel_options(keepalive)
        self.book = book if book is not None else LoadBook()
        self._on_health = on_health
        self._up_at = up_at
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
        health: GpuProbe
        if gpu.protocol == "openai":
            health = OpenAIHealth(self._session, f"http://{gpu.address}")
        else:
            channel = dial(gpu.address, gpu.credentials, self._channel_options)
            self._channels[gpu.name] = channel
            health = HealthChecker(channel, name=gpu.name)
        backend = _Backend(gpu, health)
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
        the new models (a recent success notwithstanding) and scrapes the new metrics
        URL; a new address re-opens its channel (and restarts its poll)."""
        backend = self._backends.get(gpu.name)
        if backend is None:
            raise ValueError(f"GPU {gpu.name!r} is not monitored")
        if backend.gpu == gpu:
            return
        if backend.gpu.address != gpu.address or backend.gpu.protocol != gpu.protocol:
            await self.remove(gpu.name)
            self.add(gpu)
            return
        backend.gpu = gpu
        backend.metrics_ok = None
        # Due at its next wake; no check yet of the new models, so none is skipped.
        backend.scrape_due = backend.check_due = backend.checked_at = float("-inf")
        self.gpus = tuple(gpu if g.name == gpu.name else g for g in self.gpus)

    async def stop(self) -> None:
        """Cancel the polls, then close the channels and the HTTP session."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    def skipped(self, name: str) -> tuple[int, int]:
        """Checks and scrapes of GPU ``name`` that passive evidence stood in for."""
        backend = self._backends.get(name)
        return (0, 0) if backend is None else (backend.skipped_checks, backend.skipped_scrapes)

    async def _poll_loop(self, backend: _Backend, session: aiohttp.ClientSession) -> None:
        while True:
            started = self._clock()
            step = jittered(self.interval_s, self._rng)
            steps: list[Awaitable[None]] = []
            if started >= backend.scrape_due:
                reported = self._reported_at(backend.gpu.name, started)
                if started - reported < step:  # its own report is the sample
                    backend.scrape_due = reported + step
                    backend.skipped_scrapes += 1
                else:
                    backend.scrape_due = started + step
                    steps.append(_logged(self._scrape, backend, session))
            if started >= backend.check_due:
                up = self._up_at(backend.gpu.name)
                recent = started - backend.checked_at < CHECK_AT_LEAST_EVERY * self.interval_s
                if started - up < step and recent:  # that success is the evidence
                    backend.check_due = up + step
                    backend.skipped_checks += 1
                else:
                    backend.check_due, backend.checked_at = started + step, started
                    steps.append(_logged(self._check, backend))
            # Both within one timeout_s; a bug is logged, never ends this GPU's loop.
            await asyncio.gather(*steps)
            wake = min(backend.scrape_due, backend.check_due)
            await asyncio.sleep(max(0.0, wake - self._clock()))

    def _reported_at(self, name: str, now: float) -> float:
        """When GPU ``name``'s own load report (a trailer) was taken, -inf if none."""
        sample = self.book.newest.get(name)
        if sample is None or sample.source != "trailer" or sample.taken_at > now:
            return float("-inf")
        return sample.taken_at

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
                    "metrics of GPU %s unusable at %s (%s); its load goes stale",
                    *(name, url, error),
                    extra={"event": "gpu_metrics_lost", "gpu": name, "error": error},
                )
            backend.metrics_ok = False
            return
        self.book.update(name, LoadSample(*load, taken_at=self._clock(), source="metrics"))
        if backend.metrics_ok is False:
            fields = {"event": "gpu_metrics_back", "gpu": name}
            log.info("metrics of GPU %s usable again", name, extra=fields)
        backend.metrics_ok = True

    async def _check(self, backend: _Backend) -> None:
        check = await backend.health.check_gpu(backend.gpu.models, self.timeout_s)
        if not check.slow:
            backend.ready_models = check.ready
        self._on_health(backend.gpu.name, check)


async def _logged(step: Callable[..., Awaitable[None]], backend: _Backend, *args: Any) -> None:
    """``step(backend, *args)``, a bug in it logged. The step's coroutine is made here, in
    the gathered task, so a poll cancelled before that task ran leaves none unawaited."""
    try:
        await step(backend, *args)
    except Exception:
        log.exception("load monitor poll of GPU %s failed", backend.gpu.name)
