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
    limit = _Limit(task, committed, loop)
    timer = loop.call_at(loop.time() + limit_s, limit.at_limit)
    try:
        result = await send
    except BaseException as exc:
        if not limit.expired:
            raise
        # grpc may report the cancellation of its call as CANCELLED.
        ours = task.uncancel() <= cancelling and isinstance(exc, asyncio.CancelledError)
        if ours or isinstance(exc, grpc.aio.AioRpcError):
            raise PerTryExpired(limit_s) from None
        raise
    finally:
        timer.cancel()
        if limit.soon is not None:
            limit.soon.cancel()
    if limit.expired:
        task.uncancel()
    return result


class _Limit:
    """One attempt's limit, as it passes. An object, not two closures: compiled with
    mypyc (``sim.native``) a closure's environment holds the closures defined in it, a
    cycle per attempt that only the cyclic GC frees (a simulated run does without)."""

    __slots__ = ("committed", "expired", "loop", "soon", "task")

    def __init__(
        self,
        task: asyncio.Task[object],
        committed: Callable[[], bool],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.task, self.committed, self.loop = task, committed, loop
        self.expired = False
        self.soon: asyncio.Handle | None = None

    def at_limit(self) -> None:
        if not self.committed():
            self.soon = self.loop.call_soon(self.cancel)

    def cancel(self) -> None:
        self.expired = True
        self.task.cancel()
