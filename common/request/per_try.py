"""Envoy's per-try timeout around one attempt, cancelling it only while uncommitted.

``within_per_try(send, committed, limit_s)`` awaits ``send`` (one attempt to one
child). If ``limit_s`` passes while ``committed()`` is still False (nothing went
back to the caller yet) the attempt is cancelled, which cancels its gRPC call, and
``PerTryExpired`` is raised: the forwarding loop moves the request to the next
child. Once committed the attempt runs to its own end, however long a legitimate
generation takes. No task is created: the attempt runs in the caller's task under
an ``asyncio.timeout`` scope that is armed only when the limit passes uncommitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

R = TypeVar("R")


class PerTryExpired(Exception):
    """An attempt sent nothing back within its per-try timeout and was cancelled."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"per-try timeout: nothing back within {limit_s:.2f}s")
        self.limit_s = limit_s


async def within_per_try(
    send: Awaitable[R], committed: Callable[[], bool], limit_s: float | None
) -> R:
    """``await send``, cancelled with ``PerTryExpired`` if ``limit_s`` (None: no limit)
    passes before ``committed()`` turns True (see the module docstring)."""
    if limit_s is None:
        return await send
    loop = asyncio.get_running_loop()
    scope = asyncio.timeout(None)

    def expire() -> None:
        if not committed():
            scope.reschedule(loop.time())

    handle = loop.call_later(limit_s, expire)
    try:
        async with scope:
            return await send
    except (TimeoutError, grpc.aio.AioRpcError):
        # The scope's own expiry (grpc may report the cancellation as CANCELLED).
        if scope.expired():
            raise PerTryExpired(limit_s) from None
        raise
    finally:
        handle.cancel()
