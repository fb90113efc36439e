"""The request path, written once: receive, validate, pick, forward, retry, stream back.

Every tier is this proxy with its own picker. A tier package supplies a
``Picker`` (ranks children best first, pure and synchronous) and a
``TierSpec``; the ``InferenceProxy`` does the rest of the V2 service:

* validation of the generate request and routing metadata (INVALID_ARGUMENT),
  unknown models (NOT_FOUND), no healthy child (UNAVAILABLE);
* forwarding with the caller's remaining deadline (Python gRPC does not
  propagate deadlines by itself);
* failover to the next-ranked child when a child is unreachable, but only
  while no response byte has gone back to the caller;
* the ``x-meridian-route`` trailer, each tier prepending its own name.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from common.children import Child, ChildSet
from common.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.geo import GeoPoint
from common.routing import ROUTE, RouteHints, parse_hints, trailer
from common.v2 import parse_generate

VERSION = "0.1.0"
# Codes that mean "this child could not take the request": try the next one.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
# Codes that also say the child itself is unreachable or broken.
CHILD_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class PickRequest:
    """What a picker sees of a request."""

    model: str
    version: str
    origin: GeoPoint | None
    session: str | None
    priority: str
    prompt_tokens: int = 0
    max_tokens: int = 0

    @property
    def work_tokens(self) -> float:
        """Work this request adds to a child, in tokens (prefill plus decode)."""
        return float(self.prompt_tokens + self.max_tokens)


class Picker(Protocol):
    """Ranks the children that may serve a request, best first. Pure: no I/O."""

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]: ...


@dataclass(frozen=True)
class TierSpec:
    """What makes a proxy one particular tier."""

    tier: str
    # Prepended to the child's x-meridian-route ("us-east" + "/" + "us-east-1a/gpu-2").
    route_prefix: str | None
    # Inner tiers believe internal metadata from the tier above; the edge does not.
    trust_internal: bool
    picker: Picker
    resolve_origin: Callable[[RouteHints], GeoPoint | None]
    max_attempts: int = 3


class InferenceProxy(pb_grpc.GRPCInferenceServiceServicer):
    """A V2 server that forwards every call to a child its picker chooses."""

    def __init__(self, spec: TierSpec, children: ChildSet) -> None:
        self.spec = spec
        self.children = children
        self.models = frozenset(m for c in children for m in c.models)

    # ------------------------------------------------------------------ admin-ish RPCs

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Any
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Any
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.children.any_healthy())

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=f"meridian-{self.spec.tier}", version=VERSION)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        pick = PickRequest(request.name, request.version, None, None, "standard")
        ranked = self.spec.picker.rank(pick, self.children.children, self.children.clock())
        return pb.ModelReadyResponse(ready=bool(ranked))

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        try:
            hints = parse_hints(
                context.invocation_metadata(), trust_internal=self.spec.trust_internal
            )
            pick = self._pick_request(request.name, request.version, hints, 0, 0)
            response: pb.ModelMetadataResponse = await self._forward_unary(
                "ModelMetadata", request, pick, hints, context
            )
            return response
        except RouteError as err:
            await context.abort(err.code, err.message, trailing_metadata=err.trailers)
            raise  # unreachable: abort raises

    # ------------------------------------------------------------------ inference

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        try:
            gen = parse_generate(request)
            hints = parse_hints(
                context.invocation_metadata(), trust_internal=self.spec.trust_internal
            )
            pick = self._pick_request(
                gen.model, gen.version, hints, gen.prompt_tokens, gen.max_tokens
            )
            response: pb.ModelInferResponse = await self._forward_unary(
                "ModelInfer", request, pick, hints, context
            )
            return response
        except RouteError as err:
            await context.abort(err.code, err.message, trailing_metadata=err.trailers)
            raise

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        try:
            hints = parse_hints(
                context.invocation_metadata(), trust_internal=self.spec.trust_internal
            )
            await _StreamForward(self, hints, context).run(request_iterator)
        except RouteError as err:
            await context.abort(err.code, err.message, trailing_metadata=err.trailers)

    # ------------------------------------------------------------------ shared mechanics

    def _pick_request(
        self, model: str, version: str, hints: RouteHints, prompt_tokens: int, max_tokens: int
    ) -> PickRequest:
        if model not in self.models:
            raise RouteError.not_found(
                f"model {model!r} is not served here; known models: {sorted(self.models)}"
            )
        return PickRequest(
            model=model,
            version=version,
            origin=self.spec.resolve_origin(hints),
            session=hints.session,
            priority=hints.priority,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )

    def rank(self, pick: PickRequest) -> list[Child]:
        """Ranked candidates; UNAVAILABLE naming the reasons when there are none."""
        ranked = self.spec.picker.rank(pick, self.children.children, self.children.clock())
        if not ranked:
            raise RouteError.unavailable(self._nothing_healthy(pick.model))
        return ranked[: self.spec.max_attempts]

    def _nothing_healthy(self, model: str) -> str:
        down = [f"{c.name} ({c.last_error or 'no capacity'})" for c in self.children if c.models]
        return f"no healthy {self._child_kind()} can serve model {model!r}: " + "; ".join(down)

    def _child_kind(self) -> str:
        return {"global": "region", "regional": "zone", "local": "GPU"}.get(self.spec.tier, "child")

    def route_of(self, child: Child, child_trailers: Any) -> str:
        below = trailer(child_trailers, ROUTE) or child.name
        return f"{self.spec.route_prefix}/{below}" if self.spec.route_prefix else below

    @staticmethod
    def timeout(context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        if remaining is None:
            return None
        if remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline spent before forwarding")
        return float(remaining)

    async def _forward_unary(
        self,
        method: str,
        request: Any,
        pick: PickRequest,
        hints: RouteHints,
        context: grpc.aio.ServicerContext,
    ) -> Any:
        failures: list[str] = []
        for attempt, child in enumerate(self.rank(pick)):
            assert child.stub is not None
            call = getattr(child.stub, method)(
                request,
                metadata=hints.downstream_metadata(pick.origin, hints.attempt + attempt),
                timeout=self.timeout(context),
            )
            child.outstanding_requests += 1
            child.outstanding_work += pick.work_tokens
            try:
                response = await call
                trailers = await call.trailing_metadata()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    raise RouteError(exc.code(), exc.details() or "", _passable(exc)) from None
                if exc.code() in CHILD_DOWN_CODES:
                    self.children.mark_failed(child, f"{exc.code().name}: {exc.details()}")
                failures.append(f"{child.name}: {exc.details()}")
                continue
            finally:
                child.outstanding_requests -= 1
                child.outstanding_work -= pick.work_tokens
            context.set_trailing_metadata(_with_route(trailers, self.route_of(child, trailers)))
            return response
        raise RouteError.unavailable(
            f"every {self._child_kind()} tried for model {pick.model!r} failed: "
            + "; ".join(failures)
        )


def _passable(exc: grpc.aio.AioRpcError) -> tuple[tuple[str, str], ...]:
    """Trailers of a child's error worth passing up (e.g. retry-after-ms)."""
    return tuple(
        (k, v)
        for k, v in exc.trailing_metadata() or ()
        if isinstance(v, str) and not k.startswith("grpc-")
    )


def _with_route(trailers: Any, route: str) -> tuple[tuple[str, str], ...]:
    kept = tuple(
        (k, v)
        for k, v in trailers or ()
        if k != ROUTE and isinstance(v, str) and not k.startswith("grpc-")
    )
    return (*kept, (ROUTE, route))


class _StreamForward:
    """One client stream relayed to one child stream.

    The child is chosen at the first valid request. Until the child's first
    response reaches the client, the requests sent so far are kept and
    replayed on the next-ranked child if this one fails; after that, a child
    failure ends the stream with the child's status. Invalid requests get an
    ``error_message`` response and the stream goes on, as in Triton.
    """

    def __init__(
        self, proxy: InferenceProxy, hints: RouteHints, context: grpc.aio.ServicerContext
    ) -> None:
        self.proxy = proxy
        self.hints = hints
        self.context = context
        self.candidates: list[Child] = []
        self.failures: list[str] = []
        self.child: Child | None = None
        self.call: Any = None
        self.pick: PickRequest | None = None
        self.replay: list[pb.ModelInferRequest] | None = []
        self.client_done = False
        self.upstream_ready = asyncio.Event()
        self.lock = asyncio.Lock()
        self.write_lock = asyncio.Lock()

    async def run(self, request_iterator: AsyncIterator[pb.ModelInferRequest]) -> None:
        reader = asyncio.create_task(self._read_client(request_iterator))
        try:
            await self._relay(reader)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if self.call is not None:
                self.call.cancel()
            self._release()

    async def _write(self, response: pb.ModelStreamInferResponse) -> None:
        async with self.write_lock:
            await self.context.write(response)

    async def _read_client(self, request_iterator: AsyncIterator[pb.ModelInferRequest]) -> None:
        try:
            async for request in request_iterator:
                try:
                    gen = parse_generate(request)
                    if self.pick is None:
                        self.pick = self.proxy._pick_request(
                            gen.model, gen.version, self.hints, gen.prompt_tokens, gen.max_tokens
                        )
                        self.candidates = self.proxy.rank(self.pick)
                        async with self.lock:
                            await self._open_next()
                    elif gen.model not in self.proxy.models:
                        raise RouteError.not_found(f"model {gen.model!r} is not served here")
                except RouteError as err:
                    if self.pick is None and err.code == grpc.StatusCode.UNAVAILABLE:
                        raise
                    await self._write(pb.ModelStreamInferResponse(error_message=str(err)))
                    continue
                async with self.lock:
                    if self.replay is not None:
                        self.replay.append(request)
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        await self.call.write(request)
        finally:
            self.client_done = True
            async with self.lock:
                if self.call is not None:
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        await self.call.done_writing()
            self.upstream_ready.set()

    async def _open_next(self) -> None:
        """Open the stream on the next candidate and replay what it missed (lock held)."""
        self._release()
        if not self.candidates:
            assert self.pick is not None
            raise RouteError.unavailable(
                f"every {self.proxy._child_kind()} tried for model {self.pick.model!r} failed: "
                + "; ".join(self.failures)
            )
        self.child = self.candidates.pop(0)
        assert self.child.stub is not None and self.pick is not None
        self.call = self.child.stub.ModelStreamInfer(
            metadata=self.hints.downstream_metadata(
                self.pick.origin, self.hints.attempt + len(self.failures)
            ),
            timeout=self.proxy.timeout(self.context),
        )
        self.child.outstanding_requests += 1
        self.child.outstanding_work += self.pick.work_tokens
        for request in self.replay or ():
            await self.call.write(request)
        if self.client_done:
            await self.call.done_writing()
        self.upstream_ready.set()

    def _release(self) -> None:
        if self.child is not None and self.pick is not None:
            self.child.outstanding_requests -= 1
            self.child.outstanding_work -= self.pick.work_tokens
            self.child = None

    async def _relay(self, reader: asyncio.Task[None]) -> None:
        while True:
            await self.upstream_ready.wait()
            if self.call is None:
                await reader  # the client ended without a valid request, or reading failed
                return
            call, child = self.call, self.child
            assert child is not None
            try:
                async for response in call:
                    self.replay = None  # a byte went back: no failover from here on
                    await self._write(response)
                trailers = await call.trailing_metadata()
                self.context.set_trailing_metadata(
                    _with_route(trailers, self.proxy.route_of(child, trailers))
                )
                await reader
                return
            except grpc.aio.AioRpcError as exc:
                if call.cancelled() and reader.done():
                    return
                if self.replay is None or exc.code() not in FAILOVER_CODES:
                    raise RouteError(exc.code(), exc.details() or "", _passable(exc)) from None
                self.proxy.children.mark_failed(child, f"{exc.code().name}: {exc.details()}")
                self.failures.append(f"{child.name}: {exc.details()}")
                async with self.lock:
                    await self._open_next()
