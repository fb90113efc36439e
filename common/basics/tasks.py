"""Stopping background tasks for sure.

A retry loop around a grpc.aio call can swallow a cancellation: grpc may turn it
into an ``AioRpcError(CANCELLED)``, which the loop catches like any failed call
and retries. Awaiting such a task after one ``cancel()`` hangs forever, so this
cancels again until the task ends, within a bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again any that carry
    on; after ``timeout_s`` the ones left are logged and abandoned."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: a failure here was logged where it happened
    if pending:
        log.warning("%d background task(s) did not stop: %s", len(pending), pending)
