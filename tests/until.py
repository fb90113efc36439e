"""Waiting in a test for what a server or a background task records a little later."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(
    done: Callable[[], bool], timeout_s: float = 5.0, what: str = "", poll_s: float = 0.01
) -> None:
    """Until ``done()``; fails after ``timeout_s``. A server's metrics, spans and logs of a
    call are written after the status went out (an abort ends the call at once), so a
    client that looks the moment it has its answer can look too early."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not done within {timeout_s:g} s {what}".rstrip()
        await asyncio.sleep(poll_s)


def wait_until(done: Callable[[], bool], timeout_s: float = 15.0, what: str = "") -> None:
    """``until`` for a test outside an event loop (a fleet of processes), polled every
    100 ms: each look is usually a call to a server."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not done within {timeout_s:g} s {what}".rstrip()
        time.sleep(0.1)
