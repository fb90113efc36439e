"""Relaying a bidirectional ModelStreamInfer through one tier: the stream's ``Attempt``.

One client stream is relayed to one child stream, chosen at the first valid
request. Until the child's first response reaches the client the requests sent
so far are kept, so the forwarding loop (``common.request.forwarding``) can replay
them on the next child if this one fails; after that, a child failure ends the
stream with the child's status. Invalid requests get an ``error_message``
response and the stream goes on, as in Triton.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from common.basics.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.request.call import CallRecord
from common.request.children import Child
from common.request.forwarding import Metadata
from common.request.pick import PickRequest
from common.request.v2 import GenerateRequest

# Gives back what admitting a request took (a tenant's concurrency slot).
Release = Callable[[], None]


def no_release() -> None:
    """The release of an admission that took nothing."""
    return None


class StreamRelay:
    """One client stream, read by a task of its own while ``send`` relays the child's.

    ``parse`` validates each request (raises RouteError); ``place`` turns the first
    valid one into the stream's pick and admits it (returning the admission's
    release); ``check_served`` vets the later ones. ``record`` learns the model,
    the prompt size and how many responses went back.
    """

    method = "ModelStreamInfer"

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        record: CallRecord,
        *,
        parse: Callable[[pb.ModelInferRequest], GenerateRequest],
        place: Callable[[GenerateRequest], Awaitable[tuple[PickRequest, Release]]],
        check_served: Callable[[GenerateRequest], None],
    ) -> None:
        self.context = context
        self.record = record
        self.parse = parse
        self.place = place
        self.check_served = check_served
        self.pick: PickRequest | None = None
        self.release: Release | None = None
        # What the next child must be sent again; None once a response went back.
        self.replay: list[pb.ModelInferRequest] | None = []
        self.call: Any = None
        self.client_done = False
        self.placed = asyncio.Event()
        # Orders the reader's writes to the child against opening and replaying.
        self.lock = asyncio.Lock()
        self.write_lock = asyncio.Lock()

    @property
    def committed(self) -> bool:
        return self.replay is None

    async def relay(
        self,
        requests: AsyncIterator[pb.ModelInferRequest],
        forward: Callable[[StreamRelay, PickRequest], Awaitable[tuple[None, str]]],
    ) -> str:
        """Relay the whole stream; the route it took ("" when it never had a valid request)."""
        reader = asyncio.create_task(self._read_client(requests))
        try:
            await self.placed.wait()
            if self.pick is None:
                await reader  # the client ended without a valid request, or reading failed
                return ""
            _, route = await forward(self, self.pick)
            await reader
            return route
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if self.call is not None and not self.call.done():
                self.call.cancel()
            if self.release is not None:
                self.release()

    async def send(
        self, child: Child, metadata: Metadata, timeout: float | None
    ) -> tuple[None, Any]:
        """Open the stream on ``child``, replay what it missed, relay its responses."""
        assert child.stub is not None
        async with self.lock:
            self.call = call = child.stub.ModelStreamInfer(metadata=metadata, timeout=timeout)
            # A child that fails at once may fail these writes with a status of grpc's
            # own; its real status comes from reading its responses below.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                for request in self.replay or ():
                    await call.write(request)
                if self.client_done:
                    await call.done_writing()
        async for response in call:
            self.replay = None  # a byte went back: no failover from here on
            self.record.completion_tokens += 1
            await self._write(response)
        return None, await call.trailing_metadata()

    async def _write(self, response: pb.ModelStreamInferResponse) -> None:
        async with self.write_lock:
            await self.context.write(response)

    async def _read_client(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        try:
            async for request in requests:
                if not self.record.model:
                    self.record.model = request.model_name
                try:
                    gen = self.parse(request)
                    if self.pick is None:
                        self.pick, self.release = await self.place(gen)
                        self.record.prompt_tokens = self.pick.prompt_tokens
                        self.placed.set()
                    else:
                        self.check_served(gen)
                except RouteError as err:
                    await self._write(pb.ModelStreamInferResponse(error_message=str(err)))
                    continue
                async with self.lock:
                    if self.replay is not None:
                        self.replay.append(request)
                    if self.call is not None:
                        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                            await self.call.write(request)
        finally:
            self.client_done = True
            async with self.lock:
                if self.call is not None:
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        await self.call.done_writing()
            self.placed.set()
