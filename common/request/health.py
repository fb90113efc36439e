"""Health of one endpoint over its gRPC channel: grpc.health.v1 and V2 readiness.

Every tier watches the health of what it routes to, in one of two ways, both here:

- ``watch(report, poll_s)``: follow grpc.health.v1 ``Watch`` (a push: a child that
  stops serving, or whose process dies and breaks the stream, is reported at once);
  a broken stream is re-opened with the shared back-off (0.1 s doubling to 1 s).
  The regional and global tiers watch their children so. Over a channel to a name
  with several replicas (``common.request.replicas``) the stream is on one of
  them, so a break or a NOT_SERVING is confirmed first: ``Check`` over the channel
  (round_robin sends it to a replica in rotation, up to ``CONFIRM_CHECKS`` times);
  one that says SERVING overrules it and the watch is re-opened on another replica.
- ``check_gpu(models, timeout_s)``: one poll, grpc.health.v1 ``Check`` of the V2
  service (the server-wide ``""`` when the server does not know that name), then
  V2 ``ModelReady`` for every model, all within one timeout. The local tier's
  ``BackendMonitor`` polls its GPUs so, on a jittered interval. Its ``GpuCheck``
  tells a server that answered (SERVING or not) from one that failed the call,
  and both from a check that ran out of time (``slow``): a slow probe is no
  verdict, since under load the prober's own deadline is what fails first.

**Servers without grpc.health.v1** (MLServer and other stock V2 servers register
none): the first health call that answers UNIMPLEMENTED switches this endpoint to
V2 readiness, a decision learned at run time and kept per checker (so per child):
``check_gpu`` asks ``ServerReady`` instead of ``Check`` (then ``ModelReady`` as
before, the same ``GpuCheck`` shapes and so the same verdicts), and ``watch``
polls ``ServerReady`` every ``poll_s``. grpc.health.v1 is asked again every
``recheck_s`` (a server upgraded in place may have gained it); the first answer
from it switches back. Each switch is logged once (event ``health_source``).

``server_ready(timeout_s)`` is the V2 ``ServerReady`` probe a tier sends a child
that is down (a watch reports only changes). Results are ``(healthy, reason)``;
the reason says what failed and is what operators see as the last error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.basics.backoff import Backoff
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2_SERVICE

log = logging.getLogger(__name__)

# Called with (healthy, reason) on every health report of a watch.
Report = Callable[[bool, str], None]

# A broken health watch is re-opened after 0.1 s, doubling to 1 s.
WATCH_RETRY_MIN_S = 0.1
WATCH_RETRY_MAX_S = 1.0
# A break or NOT_SERVING is confirmed by this many Checks, each within CONFIRM_TIMEOUT_S
# (a replica reached over a live connection answers in milliseconds; a dead name's
# Check fails at once, a hung one's times out).
CONFIRM_CHECKS = 2
CONFIRM_TIMEOUT_S = 0.25
# An endpoint found without grpc.health.v1 is asked for it again this often.
HEALTH_RECHECK_S = 60.0
# Where an endpoint's health comes from (the ``source`` of a ``health_source`` event).
GRPC_HEALTH, V2_READINESS = "grpc.health.v1", "V2 ServerReady/ModelReady"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(frozen=True)
class GpuCheck:
    """One health check of a GPU server: ``healthy`` only if SERVING with a model ready.

    ``answered``: the server itself answered (SERVING or not, a model ready or not),
    so an unhealthy check is its own verdict. ``slow``: the check ran out of time
    before the server answered: it says nothing of the server's health. Neither:
    the call failed (no connection, reset, an error status).
    """

    healthy: bool
    reason: str
    ready: frozenset[str] = frozenset()
    answered: bool = True
    slow: bool = False


class HealthChecker:
    """The health of one endpoint, over a channel its owner opened and closes.

    Holds no state between calls but the stubs and where this endpoint's health
    comes from (``v2_readiness``, learned at run time: see the module docstring);
    what a report means (mark a child down, drop a GPU from the free pools) is the
    caller's. ``name`` names the endpoint in the log.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        service: str = V2_SERVICE,
        *,
        name: str = "",
        recheck_s: float = HEALTH_RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.name = name or "endpoint"
        self.health = health_pb2_grpc.HealthStub(channel)
        self.v2 = pb_grpc.GRPCInferenceServiceStub(channel)
        self.recheck_s = recheck_s
        self.clock = clock
        # True once grpc.health.v1 answered UNIMPLEMENTED: health from V2 readiness,
        # grpc.health.v1 asked again from ``_recheck_at`` on.
        self.v2_readiness = False
        self._recheck_at = float("inf")

    def _learn(self, v2_readiness: bool) -> None:
        """Record where this endpoint's health comes from; log a switch once."""
        if v2_readiness:
            self._recheck_at = self.clock() + self.recheck_s
        if v2_readiness == self.v2_readiness:
            return
        self.v2_readiness = v2_readiness
        source = V2_READINESS if v2_readiness else GRPC_HEALTH
        fields = {"event": "health_source", "child": self.name, "source": source}
        if v2_readiness:
            log.info(
                "%s has no grpc.health.v1 (UNIMPLEMENTED): health from V2 ServerReady and "
                "ModelReady, grpc.health.v1 asked again every %.0f s",
                *(self.name, self.recheck_s),
                extra=fields,
            )
        else:
            log.info("%s serves grpc.health.v1 now: health from it", self.name, extra=fields)

    async def watch(self, report: Report, poll_s: float | None = None) -> None:
        """Follow ``Watch`` until cancelled, reporting every status it streams and every
        break. Without a health service (UNIMPLEMENTED): report ``ServerReady`` every
        ``poll_s`` instead, asking ``Watch`` again every ``recheck_s``; with ``poll_s``
        None, return then.

        Cancel it with ``common.basics.tasks.cancel_and_wait``: grpc may turn a
        cancellation into an ``AioRpcError(CANCELLED)``, which this loop takes for a
        broken stream."""
        while True:
            await self._follow(report)  # returns on UNIMPLEMENTED
            self._learn(True)
            if poll_s is None:
                return
            while self.clock() < self._recheck_at:
                report(*await self.server_ready(timeout_s=poll_s))
                await asyncio.sleep(poll_s)

    async def _follow(self, report: Report) -> None:
        """``Watch`` until it answers UNIMPLEMENTED, re-opened with back-off when broken
        (the back-off resets whenever a status arrives)."""
        request = health_pb2.HealthCheckRequest(service=self.service)
        backoff = Backoff(WATCH_RETRY_MIN_S, WATCH_RETRY_MAX_S)
        while True:
            call = self.health.Watch(request)
            try:
                async for reply in call:
                    self._learn(False)
                    if reply.status == _SERVING:
                        backoff.reset()  # not on NOT_SERVING: an overruled one re-opens
                        report(True, "health: serving")
                    elif await self._another_serves():
                        break  # this replica does not: watch another one
                    else:
                        report(False, "health: not serving")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
                if not await self._another_serves():
                    report(False, f"health: {exc.code().name}: {exc.details()}")
            finally:
                call.cancel()
            await asyncio.sleep(backoff.next_s())

    async def _another_serves(self) -> bool:
        """Whether a ``Check`` over the channel finds the service SERVING: another
        replica behind the name serves, though the one watched broke or stopped."""
        request = health_pb2.HealthCheckRequest(service=self.service)
        for _ in range(CONFIRM_CHECKS):
            try:
                reply = await self.health.Check(request, timeout=CONFIRM_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                return False  # no replica in rotation answers: the name is down
            if reply.status == _SERVING:
                return True
        return False

    async def server_ready(self, timeout_s: float) -> tuple[bool, str]:
        """V2 ``ServerReady``: ``(True, "")`` when it says ready."""
        try:
            reply = await self.v2.ServerReady(pb.ServerReadyRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return False, f"probe: {exc.code().name}: {exc.details()}"
        if reply.ready:
            return True, ""
        return False, "probe: ServerReady says not ready"

    async def check_gpu(self, models: Iterable[str], timeout_s: float) -> GpuCheck:
        """The health of a GPU server, all within ``timeout_s``: healthy only if
        SERVING (or, without grpc.health.v1, ServerReady) with at least one of
        ``models`` ready (see ``GpuCheck``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def remaining() -> float:
            return max(0.0, deadline - loop.time())

        serving = await self._serving(remaining)
        if not serving.healthy:
            return serving
        return await self._models_ready(sorted(models), remaining, serving.reason)

    async def _serving(self, remaining: Callable[[], float]) -> GpuCheck:
        """Whether the server serves: grpc.health.v1 ``Check``, or ``ServerReady`` while
        this endpoint is known to have no health service (and when ``Check`` says so)."""
        if self.v2_readiness and self.clock() < self._recheck_at:
            return await self._ready(remaining)
        check = await self._check(remaining)
        if check is None:  # UNIMPLEMENTED: no health service
            self._learn(True)
            return await self._ready(remaining)
        if check.answered:
            self._learn(False)
        elif self.v2_readiness:  # the re-check failed: no news; V2 readiness till the next
            self._learn(True)
        return check

    async def _check(self, remaining: Callable[[], float]) -> GpuCheck | None:
        """grpc.health.v1 ``Check`` of the service, or server-wide when it is unknown;
        None when the server has no health service."""
        try:
            try:
                reply = await self.health.Check(
                    health_pb2.HealthCheckRequest(service=self.service), timeout=remaining()
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                reply = await self.health.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=remaining()
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            reason = f"health check: {exc.code().name}: {exc.details()}"
            return GpuCheck(False, reason, answered=False, slow=exc.code() == _DEADLINE)
        if reply.status != _SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return GpuCheck(False, f"health check: {status}")
        return GpuCheck(True, "SERVING")

    async def _ready(self, remaining: Callable[[], float]) -> GpuCheck:
        """V2 ``ServerReady``, as a ``GpuCheck`` (the health check of a server without
        grpc.health.v1)."""
        try:
            reply = await self.v2.ServerReady(pb.ServerReadyRequest(), timeout=remaining())
        except grpc.aio.AioRpcError as exc:
            reason = f"ServerReady: {exc.code().name}: {exc.details()}"
            return GpuCheck(False, reason, answered=False, slow=exc.code() == _DEADLINE)
        if not reply.ready:
            return GpuCheck(False, "ServerReady: not ready")
        return GpuCheck(True, "ServerReady")

    async def _models_ready(
        self, models: list[str], remaining: Callable[[], float], serving: str
    ) -> GpuCheck:
        async def model_ready(model: str) -> grpc.StatusCode | None:
            """None when ready, OK when it answered not ready, else the call's failure."""
            try:
                answer = await self.v2.ModelReady(
                    pb.ModelReadyRequest(name=model), timeout=remaining()
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return None if answer.ready else grpc.StatusCode.OK

        codes = await asyncio.gather(*(model_ready(m) for m in models))
        ready = frozenset(m for m, code in zip(models, codes, strict=True) if code is None)
        if ready:
            return GpuCheck(True, f"{serving}, {len(ready)}/{len(models)} models ready", ready)
        why = "; ".join(
            f"{m}: {'not ready' if code == grpc.StatusCode.OK else code.name}"
            for m, code in zip(models, codes, strict=True)
            if code is not None
        )
        reason = f"{serving} but no model ready ({why or 'no models configured'})"
        # Every model that did not answer ran out of time: no verdict; else the
        # server said "not ready" for one at least, or a call failed.
        failed = [code for code in codes if code is not None]
        slow = bool(failed) and all(code == _DEADLINE for code in failed)
        answered = not failed or grpc.StatusCode.OK in failed
        return GpuCheck(False, reason, answered=answered, slow=slow and not answered)
