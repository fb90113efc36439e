"""Bookkeeping of one request's attempts, and the trailers that travel back up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from common.basics.errors import RETRY_AFTER_MS, RouteError
from common.capacity.summary import CAPACITY_HINT
from common.request.routing import ROUTE, trailer


class Failover(Exception):
    """An attempt failed in a way another child may not: try the next one."""

    def __init__(
        self,
        child: str,
        code: grpc.StatusCode,
        detail: str,
        trailers: Any,
        *,
        child_down: bool = False,
    ) -> None:
        super().__init__(f"{child}: {code.name}: {detail}")
        self.code = code
        self.retry_after_ms = _retry_after(trailers)
        # The child itself is gone: moving away from it cannot amplify load on it.
        self.child_down = child_down


@dataclass
class Attempts:
    """The children tried for one request and why each failed."""

    tried: list[str] = field(default_factory=list)
    failures: list[Failover] = field(default_factory=list)
    # A retry counted against the budget until its attempt ends.
    holding_retry: bool = False

    def error(self, kind: str, model: str) -> RouteError:
        """The status to return once no attempt is left: RESOURCE_EXHAUSTED (with the
        soonest retry-after) when every child shed load, else UNAVAILABLE."""
        reasons = "; ".join(str(f) for f in self.failures) or "no attempt was possible"
        if self.failures and all(
            f.code == grpc.StatusCode.RESOURCE_EXHAUSTED for f in self.failures
        ):
            wait = min((f.retry_after_ms for f in self.failures if f.retry_after_ms), default=1000)
            return RouteError.exhausted(f"every {kind} is at capacity: {reasons}", wait)
        return RouteError.unavailable(f"every {kind} tried for model {model!r} failed: {reasons}")


def _retry_after(trailers: Any) -> int | None:
    value = trailer(trailers, RETRY_AFTER_MS)
    return int(value) if value is not None and value.isdigit() else None


def passable(trailers: Any) -> tuple[tuple[str, str], ...]:
    """Trailers of a child's error worth passing up (e.g. retry-after-ms)."""
    return tuple(
        (k, v)
        for k, v in trailers or ()
        if isinstance(v, str) and not k.startswith("grpc-") and k != CAPACITY_HINT
    )


def with_route(trailers: Any, route: str, hint: str | None = None) -> tuple[tuple[str, str], ...]:
    """The child's trailers as this tier passes them up: its route prefixed, and its own
    capacity hint in place of the child's."""
    kept = tuple(
        (k, v)
        for k, v in trailers or ()
        if k not in (ROUTE, CAPACITY_HINT) and isinstance(v, str) and not k.startswith("grpc-")
    )
    own = ((CAPACITY_HINT, hint),) if hint else ()
    return (*kept, (ROUTE, route), *own)
