"""Envoy's per-try timeout around one attempt, cancelling it only while uncommitted.

``within_per_try(send, committed, limit_s)`` awaits ``send`` (one attempt to one
child). If ``limit_s`` passes while ``committed()`` is still False (nothing went
back to the caller yet) the attempt is cancelled, which cancels its gRPC call, and
``PerTryExpired`` is raised: the forwarding loop moves the request to the next
child. Once committed the attempt runs to its own end, however long a legitimate
generation takes. No task is created: the attempt runs in the caller's task, which
is cancelled (as ``asyncio.timeout`` would) only when the limit passes uncommitted.
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
    task = asyncio.current_task(loop)
    if task is None:
        raise RuntimeError("within_per_try runs in a task")
    # asyncio.timeout's own steps, without its object and context manager on every
    # attempt (most end before their limit): at the limit, if still uncommitted, the
    # task is cancelled on the next turn of the loop; the cancellation this caused is
    # taken back on the way out and, unless another came meanwhile, becomes the expiry.
    cancelling = task.cancelling()
    expired = False
    soon: asyncio.Handle | None = None

    def cancel() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    def at_limit() -> None:
        nonlocal soon
        if not committed():
            soon = loop.call_soon(cancel)

    timer = loop.call_at(loop.time() + limit_s, at_limit)
    try:
        result = await send
    except BaseException as exc:
        if not expired:
            raise
        # grpc may report the cancellation of its call as CANCELLED.
        ours = task.uncancel() <= cancelling and isinstance(exc, asyncio.CancelledError)
        if ours or isinstance(exc, grpc.aio.AioRpcError):
            raise PerTryExpired(limit_s) from None
        raise
    finally:
        timer.cancel()
        if soon is not None:
            soon.cancel()
    if expired:
        task.uncancel()
    return result
