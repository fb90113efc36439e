"""Relaying a bidirectional ModelStreamInfer through one tier.

One client stream is relayed to one child stream, chosen at the first valid
request. Until the child's first response reaches the client, the requests
sent so far are kept and replayed on the next child if this one fails (the
same retry rules as unary calls); after that, a child failure ends the stream
with the child's status. Invalid requests get an ``error_message`` response
and the stream goes on, as in Triton.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from common.basics.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.request.attempts import Attempts, with_route
from common.request.balancer import Lease
from common.request.pick import PickRequest
from common.request.routing import RouteHints
from common.request.v2 import parse_generate

if TYPE_CHECKING:
    from common.request.proxy import InferenceProxy


class StreamForward:
    """One client stream relayed to one child stream, with failover before the first byte."""

    def __init__(
        self,
        proxy: InferenceProxy,
        hints: RouteHints,
        context: grpc.aio.ServicerContext,
        span: Span = trace.INVALID_SPAN,
    ) -> None:
        self.proxy = proxy
        self.span = span  # the tier's server span: decisions and attempts nest under it
        self.hints = hints
        self.context = context
        self.attempts = Attempts()
        self.lease: Lease | None = None
        self.call: Any = None
        self.pick: PickRequest | None = None
        self.replay: list[pb.ModelInferRequest] | None = []
        self.client_done = False
        # What the stream delivered, for its usage record.
        self.route = ""
        self.responses = 0
        self.release: Any = None
        self.upstream_ready = asyncio.Event()
        self.lock = asyncio.Lock()
        self.write_lock = asyncio.Lock()

    async def run(self, request_iterator: AsyncIterator[pb.ModelInferRequest]) -> None:
        self.proxy.retry_budget.request_started()
        reader = asyncio.create_task(self._read_client(request_iterator))
        try:
            await self._relay(reader)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if self.call is not None and not self.call.done():
                self.call.cancel()
            self._settle(grpc.StatusCode.CANCELLED, ())
            self.proxy.end_attempt(self.attempts)
            self.proxy.retry_budget.request_finished()
            if self.release is not None:
                self.release()

    async def _write(self, response: pb.ModelStreamInferResponse) -> None:
        async with self.write_lock:
            await self.context.write(response)

    async def _read_client(self, request_iterator: AsyncIterator[pb.ModelInferRequest]) -> None:
        try:
            async for request in request_iterator:
                try:
                    gen = parse_generate(request, self.proxy.limits)
                    if self.pick is None:
                        pick = self.proxy.pick_request(gen.model, gen.version, self.hints, gen)
                        self.release = await self.proxy.admission.admit(self.hints, pick)
                        self.pick = pick
                        async with self.lock:
                            await self._open_next()
                    elif gen.model not in self.proxy.models:
                        raise RouteError.not_found(f"model {gen.model!r} is not served here")
                except RouteError as err:
                    if self.pick is not None and self.call is None:
                        raise  # no child could take the stream: end it with that status
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

    def _settle(self, code: grpc.StatusCode, trailers: Any, detail: str = "") -> None:
        if self.lease is not None:
            self.proxy.settle(self.lease, code, trailers, detail)
            self.lease = None

    async def _open_next(self) -> None:
        """Open the stream on the next child and replay what it missed (lock held)."""
        assert self.pick is not None
        self.proxy.end_attempt(self.attempts)
        self.lease = await self.proxy.next_lease(self.pick, self.attempts, self.context, self.span)
        n = len(self.attempts.tried) - 1
        self.proxy.tracing.begin_attempt(
            "ModelStreamInfer", self.lease, self.hints.attempt + n, self.span
        )
        child = self.lease.child
        assert child.stub is not None
        self.call = child.stub.ModelStreamInfer(
            metadata=self.proxy.child_metadata(self.hints, self.pick, self.lease, n, self.span),
            timeout=self.proxy.lease_timeout(self.lease, self.context),
        )
        for request in self.replay or ():
            await self.call.write(request)
        if self.client_done:
            await self.call.done_writing()
        self.upstream_ready.set()

    async def _relay(self, reader: asyncio.Task[None]) -> None:
        while True:
            await self.upstream_ready.wait()
            if self.call is None:
                await reader  # the client ended without a valid request, or reading failed
                return
            call, lease = self.call, self.lease
            assert lease is not None
            try:
                async for response in call:
                    self.replay = None  # a byte went back: no failover from here on
                    self.responses += 1
                    await self._write(response)
                trailers = await call.trailing_metadata()
                self._settle(grpc.StatusCode.OK, trailers)
                self.route = self.proxy.route_of(lease.child, trailers)
                self.context.set_trailing_metadata(
                    with_route(
                        trailers, self.route, self.proxy.hint(self.pick.model if self.pick else "")
                    )
                )
                await reader
                return
            except grpc.aio.AioRpcError as exc:
                if call.cancelled() and reader.done():
                    return
                self.lease = None
                failover = self.proxy.failover_or_raise(lease, exc)
                if self.replay is None:
                    raise RouteError(exc.code(), exc.details() or "") from None
                self.attempts.failures.append(failover)
                async with self.lock:
                    self.call = None
                    await self._open_next()
