"""The forwarding loop, written once for unary and streaming calls (and the simulator).

``Forwarder.forward`` reserves a child through the tier's balancer, sends the
attempt with the caller's remaining deadline (Python gRPC does not propagate
deadlines by itself), and on a failure that another child may not share (the
tier's ``failover_codes``) tries the next one: after a fully jittered exponential
back-off, inside a retry budget (Envoy's: 20 % of active requests, at least 3),
at most ``max_attempts`` times. Failing over away from a child found down does
not count against the budget. A unary call and a stream differ only in when the
first response byte counts as sent (``Attempt.committed``): from then on, a
failure ends the call with the child's status.

The forwarder knows nothing of the gRPC call it serves: the caller gives its
deadline as a time on the forwarder's ``clock`` (``deadline_in`` turns a context's
``time_remaining()`` into one) and sets the trailers ``forward`` hands back on its
own call. An absolute deadline rather than the servicer context or a callable: one
number read once per call, which the simulator (simulated clock, no context) and
tests give as easily as a server. The time left is read from it before each
reservation and again before each send, since the wait for a lease may spend it.

Each attempt also has Envoy's per-try timeout (``common.request.per_try``, its
limit from the attempt's expected service time): an attempt that has sent nothing
back to the caller when it runs out is cancelled and the request moves to the next
child (a per-try DEADLINE_EXCEEDED is a failover; only the caller's own deadline
ends the call).

On success the child's trailers go up with this tier's name prefixed to
``x-meridian-route`` and this tier's own capacity hint in place of the child's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from common.basics.backoff import backoff_delay_s
from common.basics.errors import RETRY_AFTER_MS, TENANT_QUOTA, RouteError
from common.capacity.summary import CAPACITY_HINT
from common.config.liveness import PerTryTimeout
from common.request.attempt import (
    Attempt,
    AttemptTracing,
    Downstream,
    Metadata,
)
from common.request.balancer import Balancer, Lease, Outcome
from common.request.children import Child
from common.request.output_length import OutputLengths
from common.request.per_try import PerTryExpired, within_per_try
from common.request.pick import PickRequest
from common.request.resilience import RetryBudget
from common.request.routing import ROUTE, trailer

T = TypeVar("T")
Trailers = tuple[tuple[str, str], ...]
# What a tier replaces in its child's trailers on the way up.
_REPLACED = frozenset({ROUTE, CAPACITY_HINT})
# CANCELLED from a child (not from our caller, whose cancellation ends this handler
# instead) means the child is shutting down: as safe to re-send as UNAVAILABLE.
UPPER_TIER_FAILOVER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
)


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


def passable(trailers: Any) -> Trailers:
    """Trailers of a child's error worth passing up (e.g. retry-after-ms)."""
    return tuple(
        (k, v)
        for k, v in trailers or ()
        if isinstance(v, str) and not k.startswith("grpc-") and k != CAPACITY_HINT
    )


def with_route(trailers: Any, route: str, hint: str | None = None) -> Trailers:
    """The child's trailers as this tier passes them up: its route prefixed, and its own
    capacity hint in place of the child's."""
    # A list filled in place: cheaper per answer than a generator unpacked into a tuple.
    kept = [
        (k, v)
        for k, v in trailers or ()
        if k not in _REPLACED and isinstance(v, str) and not k.startswith("grpc-")
    ]
    kept.append((ROUTE, route))
    if hint:
        kept.append((CAPACITY_HINT, hint))
    return tuple(kept)


class _Committed:
    """``attempt.committed`` read when the per-try limit passes. An object, not a
    lambda: compiled with mypyc (``sim.native``), a closure's environment holds the
    closure, a cycle per attempt that only the cyclic GC frees."""

    __slots__ = ("attempt",)

    def __init__(self, attempt: Attempt[Any]) -> None:
        self.attempt = attempt

    def __call__(self) -> bool:
        return self.attempt.committed


@dataclass(frozen=True)
class ForwardingPolicy:
    """Which child statuses fail over, how often, and how this tier names its route."""

    kind: str  # what a child is called in messages: "region", "zone", "GPU"
    # Prepended to the child's x-meridian-route ("us-east" + "/" + "us-east-1a/gpu-2").
    route_prefix: str | None = None
    failover_codes: frozenset[grpc.StatusCode] = UPPER_TIER_FAILOVER
    max_attempts: int = 3
    per_try: PerTryTimeout = field(default_factory=PerTryTimeout)


class Forwarder:
    """One tier's forwarding loop over its balancer (see the module docstring)."""

    def __init__(
        self,
        policy: ForwardingPolicy,
        balancer: Balancer,
        *,
        budget: RetryBudget | None = None,
        tracing: AttemptTracing | None = None,
        hint_source: Callable[[str], str | None] = lambda model: None,
        outputs: OutputLengths | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.balancer = balancer
        self.budget = budget or RetryBudget()
        # None: tracing off, and no call at all for it on the request path.
        self.tracing = tracing
        # This tier's newest capacity for a model in trailer form (capacity.summary.encode_hint).
        self.hint = hint_source
        # The answers' lengths this tier has seen: what it plans requests at.
        self.outputs = outputs or OutputLengths()
        self.rng = rng or random.Random()
        self.clock = clock

    def deadline_in(self, left: float | None) -> float | None:
        """The deadline, on ``clock``, of a caller with ``left`` seconds to go (a
        context's ``time_remaining()``); None: no deadline."""
        return None if left is None else self.clock() + left

    async def forward(
        self,
        attempt: Attempt[T],
        pick: PickRequest,
        hints: Downstream,
        deadline: float | None,
        parent: Span = trace.INVALID_SPAN,
    ) -> tuple[T, str, Trailers]:
        """The child's answer, the route it took and the trailers the caller sets on
        its own call (``with_route``); RouteError when no attempt succeeds.
        ``deadline`` is the caller's on ``clock`` (``deadline_in``), None: none."""
        attempts = Attempts()
        self.budget.request_started()
        try:
            while True:
                try:
                    lease = await self._next_lease(pick, attempts, deadline, parent)
                    n = hints.attempt + len(attempts.tried) - 1
                    tracing = self.tracing
                    if tracing is not None:
                        tracing.begin_attempt(attempt.method, lease, n, parent)
                    timeout = self._lease_timeout(lease, deadline)
                    metadata = hints.downstream_metadata(pick.origin, n, pick.prefix_blocks)
                    if tracing is not None:
                        metadata = tracing.child_metadata(metadata, lease, parent)
                    answer = await self._send(attempt, lease, metadata, timeout, attempts)
                    if answer is not None:  # else failed over: the next child
                        result, trailers = answer
                        route = self.route_of(lease.child, trailers)
                        return result, route, with_route(trailers, route, self.hint(pick.model))
                finally:
                    self._end_attempt(attempts)
        finally:
            self.budget.request_finished()

    async def _send(
        self,
        attempt: Attempt[T],
        lease: Lease,
        metadata: Metadata,
        timeout: float | None,
        attempts: Attempts,
    ) -> tuple[T, Any] | None:
        """One attempt, settled whatever happens; None: failed over, try the next child."""
        # A per-try limit the caller's deadline comes before is the caller's deadline.
        limit = self.policy.per_try.limit_s(lease.expected_s, lease.work)
        if limit is not None and timeout is not None and limit >= timeout:
            limit = None
        try:
            result, trailers = await within_per_try(
                attempt.send(lease.child, metadata, timeout), _Committed(attempt), limit
            )
        # One name per clause: compiled (the simulator's mypyc build), a name keeps
        # the type of the first clause that binds it.
        except PerTryExpired as expired:
            attempts.failures.append(self._expired(lease, expired))
            return None
        except grpc.aio.AioRpcError as failed:
            attempts.failures.append(self._failed(lease, failed, committed=attempt.committed))
            return None
        except asyncio.CancelledError:
            self.settle(lease, grpc.StatusCode.CANCELLED, ())
            raise
        except Exception as exc:  # never leak a lease, whatever went wrong
            self.settle(lease, grpc.StatusCode.INTERNAL, (), repr(exc))
            raise RouteError(grpc.StatusCode.INTERNAL, f"forwarding failed: {exc!r}") from None
        self.settle(lease, grpc.StatusCode.OK, trailers, completion=attempt.reported_completion)
        return result, trailers

    def _expired(self, lease: Lease, exc: PerTryExpired) -> Failover:
        """Settle an attempt its per-try timeout cancelled: a failover, whatever the codes."""
        code, detail = grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
        self.settle(lease, code, (), detail, timed_out=True)
        return Failover(lease.child.name, code, detail, (), child_down=not lease.child.healthy)

    def route_of(self, child: Child, child_trailers: Any) -> str:
        below = trailer(child_trailers, ROUTE) or child.name
        prefix = self.policy.route_prefix
        return f"{prefix}/{below}" if prefix else below

    async def _next_lease(
        self, pick: PickRequest, attempts: Attempts, deadline: float | None, parent: Span
    ) -> Lease:
        """Reserve the child for the next attempt: after a back-off, inside the budget."""
        n = len(attempts.tried)
        kind = self.policy.kind
        if n:
            if n >= self.policy.max_attempts:
                raise attempts.error(kind, pick.model)
            # Failing over away from a dead child is not a retry storm: only retries
            # that go back to live children count against the budget.
            if not attempts.failures[-1].child_down:
                if not self.budget.try_start_retry():
                    raise attempts.error(kind, pick.model)
                attempts.holding_retry = True
            await asyncio.sleep(backoff_delay_s(n, self.rng))
        tracing = self.tracing
        started = 0 if tracing is None else tracing.decision_started(parent)
        try:
            left = None if deadline is None else self._left(deadline)
            lease = await self.balancer.acquire(pick, attempts.tried, left)
        except RouteError as err:
            if tracing is not None:
                tracing.record_decision(parent, started, code=err.code)
            if n and err.code == grpc.StatusCode.UNAVAILABLE:
                raise attempts.error(kind, pick.model) from None
            raise
        except asyncio.CancelledError:
            if tracing is not None:
                tracing.record_decision(parent, started, code=grpc.StatusCode.CANCELLED)
            raise
        if tracing is not None:
            tracing.record_decision(parent, started, lease)
        attempts.tried.append(lease.child.name)
        return lease

    def _left(self, deadline: float) -> float:
        """Seconds left before ``deadline``; DEADLINE_EXCEEDED once it has passed."""
        left = deadline - self.clock()
        if left <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline spent before forwarding")
        return left

    def _lease_timeout(self, lease: Lease, deadline: float | None) -> float | None:
        """The time left once a lease is held (the wait for it may have spent it all)."""
        try:
            return None if deadline is None else self._left(deadline)
        except RouteError:
            self.settle(lease, grpc.StatusCode.DEADLINE_EXCEEDED, ())
            raise

    def _end_attempt(self, attempts: Attempts) -> None:
        if attempts.holding_retry:
            attempts.holding_retry = False
            self.budget.retry_finished()

    def settle(
        self,
        lease: Lease,
        code: grpc.StatusCode,
        trailers: Any,
        detail: str = "",
        *,
        timed_out: bool = False,
        completion: int | None = None,
    ) -> None:
        """Give the lease back with how its attempt ended; ``completion``: the answer's
        length as the child reported it (None: not reported)."""
        elapsed = self.clock() - lease.started_at
        if self.tracing is not None:
            self.tracing.end_attempt(lease, code, detail, elapsed)
        if completion is not None:
            self.outputs.observe(lease.model, lease.max_tokens, completion)
        outcome = Outcome(code, elapsed, completion, trailers, detail, timed_out=timed_out)
        self.balancer.release(lease, outcome)

    def _failed(self, lease: Lease, exc: grpc.aio.AioRpcError, *, committed: bool) -> Failover:
        """Settle a failed attempt; the Failover to record, or the RouteError to return."""
        trailers = exc.trailing_metadata()
        code, detail = exc.code(), exc.details() or ""
        self.settle(lease, code, trailers, detail)
        # A tenant's own quota (marked by its trailer) binds at every child alike.
        over_quota = trailer(trailers, TENANT_QUOTA) is not None
        if code in self.policy.failover_codes and not committed and not over_quota:
            return Failover(
                lease.child.name, code, detail, trailers, child_down=not lease.child.healthy
            )
        raise RouteError(code, detail, passable(trailers)) from None
