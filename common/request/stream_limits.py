"""Open streams per tenant at the edge: a stream holds resources for as long as it is
open (a connection's stream slot, a reader task, its requests' slots), so one tenant
may hold at most ``Limits.max_open_streams_per_tenant`` of them in one edge process.

Counted in process, not through Redis: a stream is bound to the edge replica that
holds its connection, so the count is exact where it matters. Over the cap, a new
stream is refused with RESOURCE_EXHAUSTED and ``retry-after-ms``; the streams
already open are untouched. The count is given back when the stream ends, however
it ends (the proxy releases in a ``finally``).
"""

from __future__ import annotations

from collections.abc import Callable

from common.basics.errors import RouteError

# When a refused caller may try again: streams live for seconds to minutes, so
# sooner than this is unlikely to find one closed.
OPEN_STREAM_RETRY_AFTER_MS = 1000


class OpenStreams:
    """How many streams each tenant has open, capped at ``limit``."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._open: dict[str, int] = {}

    def count(self, tenant: str) -> int:
        return self._open.get(tenant, 0)

    def open(self, tenant: str) -> Callable[[], None]:
        """Take one of ``tenant``'s streams; returns the release (idempotent).
        RouteError (RESOURCE_EXHAUSTED) when the tenant has ``limit`` open already."""
        held = self._open.get(tenant, 0)
        if held >= self.limit:
            raise RouteError.exhausted(
                f"tenant '{tenant}' has {held} streams open, the most one tenant may hold "
                f"(limits.max_open_streams_per_tenant); close one or send its requests "
                "on a stream already open",
                OPEN_STREAM_RETRY_AFTER_MS,
            )
        self._open[tenant] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._open[tenant] - 1
            if left:
                self._open[tenant] = left
            else:
                del self._open[tenant]

        return release
