"""Calls at once on one client connection at the edge: a cap that queues, never refuses.

HTTP/2 can cap the streams of a connection itself (SETTINGS_MAX_CONCURRENT_STREAMS,
``grpc.max_concurrent_streams``), but a client may open streams before it has read the
server's SETTINGS, and the server then resets the excess with REFUSED_STREAM, which a
stock gRPC client reports as UNAVAILABLE: a legal burst on a fresh connection turned
into errors. So the edge announces no practical HTTP/2 limit (2^31-1, as Envoy does)
and bounds a connection here instead (``ConnectionSlots``): at most
``Limits.max_streams_per_connection`` of its calls are handled at once, further calls
wait at the edge in arrival order until one ends (or their own deadline passes), and
at most ``Limits.max_queued_calls_per_connection`` may wait; beyond, a call is shed
with RESOURCE_EXHAUSTED and ``retry-after-ms``, never UNAVAILABLE.

A connection is what ``context.peer()`` names (``ipv4:host:port``: one TCP connection).
Every call counts, whatever its service: each holds a stream and a handler. At the
default cap (2^31-1) the edge installs none of this (``common.request.server``): no
call could ever wait.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.basics.errors import RETRY_AFTER_MS
from common.request.abort import abort_call
from common.request.handlers import rewrapped

# When a shed caller may try again: calls last from milliseconds to a minute, and
# a queue this long drains in well under a second at any useful cap.
QUEUE_FULL_RETRY_AFTER_MS = 500


@dataclass
class _Connection:
    slots: asyncio.Semaphore
    users: int = 0  # calls running or waiting: the entry goes when none is left
    waiting: int = 0


@dataclass
class ConnectionSlots:
    """At most ``max_calls`` calls handled at once per connection, up to ``max_queued``
    more waiting in arrival order (``asyncio.Semaphore`` is first come, first served).
    Keeps one entry per connection with a call in progress, dropped with its last call."""

    max_calls: int
    max_queued: int
    _connections: dict[str, _Connection] = field(default_factory=dict)

    @asynccontextmanager
    async def slot(self, peer: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Hold one of ``peer``'s slots for the block, waiting for one if all are taken;
        a full queue ends the call with RESOURCE_EXHAUSTED."""
        conn = self._connections.get(peer)
        if conn is None:
            conn = self._connections[peer] = _Connection(asyncio.Semaphore(self.max_calls))
        if conn.slots.locked() and conn.waiting >= self.max_queued:
            await abort_call(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this connection has {self.max_calls} calls in progress and {conn.waiting} "
                f"waiting, the most the edge holds for one connection "
                f"(limits.max_streams_per_connection, limits.max_queued_calls_per_connection); "
                "retry after the hinted delay or spread calls over more connections",
                ((RETRY_AFTER_MS, str(QUEUE_FULL_RETRY_AFTER_MS)),),
            )
        conn.users += 1
        try:
            conn.waiting += 1
            try:
                await conn.slots.acquire()
            finally:
                conn.waiting -= 1
            try:
                yield
            finally:
                conn.slots.release()
        finally:
            conn.users -= 1
            if not conn.users:
                del self._connections[peer]


class ConnectionSlotsInterceptor(grpc.aio.ServerInterceptor):
    """Runs every call inside one of its connection's slots (``ConnectionSlots``).
    Install it first among the edge's interceptors, so a waiting call runs nothing."""

    def __init__(self, slots: ConnectionSlots) -> None:
        self.slots = slots
        # The wrapped handler of each method, kept while the handler below stays the same.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        path = handler_call_details.method
        kept = self._wrapped.get(path)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self._slotted(handler)
        if len(self._wrapped) < 64:  # the services' methods, whatever paths callers try
            self._wrapped[path] = (handler, wrapped)
        return wrapped

    def _slotted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return rewrapped(handler, self._wrap)

    def _wrap(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        """``behaviour`` (a coroutine or an async generator) run inside a slot."""
        slots = self.slots
        if inspect.isasyncgenfunction(behaviour):

            async def streamed(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                async with slots.slot(context.peer(), context):
                    async for response in behaviour(request, context):
                        yield response

            return streamed

        async def called(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with slots.slot(context.peer(), context):
                result = behaviour(request, context)
                return await result if inspect.isawaitable(result) else result

        return called
