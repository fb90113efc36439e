"""The request path, written once: receive, validate, pick, forward, retry, stream back.

Every tier is this proxy with its own balancer (a picker plus whatever the
tier reserves per attempt). The ``InferenceProxy`` does the rest of the V2
service:

* validation of the generate request and routing metadata (INVALID_ARGUMENT),
  unknown models (NOT_FOUND), no healthy child (UNAVAILABLE);
* forwarding with the caller's remaining deadline (Python gRPC does not
  propagate deadlines by itself);
* retry on another child when the child could not take the request, only
  while no response byte has gone back to the caller, after a jittered
  exponential back-off and inside a retry budget (Envoy's: 20% of active
  requests, at least 3);
* the ``x-meridian-route`` trailer, each tier prepending its own name;
* tracing (``common.observability.tracing``): a server span per call, continuing the caller's
  W3C ``traceparent``; under it a ``pick`` span per decision (with a ``queue``
  span for time in the local queue) and a client span per forward attempt,
  whose context goes down as the child's ``traceparent``. The tracer defaults
  to a no-op: then each step is one cheap check and no span object is made.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint
from common.capacity.summary import CAPACITY_HINT
from common.config.access import AuthConfig, Limits
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.observability import tracing as tm
from common.request.attempts import Attempts, Failover, passable, with_route
from common.request.balancer import Balancer, Lease, Outcome
from common.request.children import Child, ChildSet
from common.request.pick import PickRequest
from common.request.prefix import MAX_CARRIED_BLOCKS, prompt_block_hashes
from common.request.resilience import RetryBudget, backoff_delay_s
from common.request.routing import ROUTE, RouteHints, parse_hints, trailer
from common.request.streaming import StreamForward
from common.request.v2 import MAX_NAME_CHARS, GenerateRequest, parse_generate
from common.tenancy.admission import Admission

VERSION = "0.1.0"
# CANCELLED from a child (not from our caller, whose cancellation ends this handler
# instead) means the child is shutting down: as safe to re-send as UNAVAILABLE.
UPPER_TIER_FAILOVER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
)


@dataclass(frozen=True)
class TierSpec:
    """What makes a proxy one particular tier."""

    tier: str
    # Prepended to the child's x-meridian-route ("us-east" + "/" + "us-east-1a/gpu-2").
    route_prefix: str | None
    # Inner tiers believe internal metadata from the tier above; the edge does not.
    trust_internal: bool
    resolve_origin: Callable[[RouteHints], GeoPoint | None]
    # Child statuses after which another child is tried (before any response byte).
    failover_codes: frozenset[grpc.StatusCode] = UPPER_TIER_FAILOVER
    max_attempts: int = 3


class InferenceProxy(pb_grpc.GRPCInferenceServiceServicer):
    """A V2 server that forwards every call to a child its balancer chooses."""

    def __init__(
        self,
        spec: TierSpec,
        children: ChildSet,
        balancer: Balancer,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        admission: Admission | None = None,
        limits: Limits | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.spec = spec
        self.tracer = tracer or trace.NoOpTracer()
        self.limits = limits or Limits()
        self.children = children
        self.balancer = balancer
        self.models = frozenset(m for c in children for m in c.models)
        self.retry_budget = RetryBudget()
        self.rng = rng or random.Random()
        self.clock = clock
        self.admission = admission or Admission(AuthConfig())
        # This tier's newest view of a model, returned to the tier above as a hint.
        # The tier's newest capacity for a model in trailer form (common.capacity.encode_hint).
        self.hint_source: Callable[[str], str | None] = lambda model: None

    @property
    def tracer(self) -> trace.Tracer:
        return self._tracer

    @tracer.setter
    def tracer(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer
        self.tracing = tm.TierTracing(tracer, self.spec.tier)

    # ------------------------------------------------------------------ admin-ish RPCs

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.children.any_healthy())

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=f"meridian-{self.spec.tier}", version=VERSION)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        pick = PickRequest(request.name, request.version, None, None, "standard")
        return pb.ModelReadyResponse(
            ready=request.name in self.models and bool(self.balancer.ranked(pick))
        )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        try:
            hints = self.hints(context)
            pick = self.pick_request(request.name, request.version, hints, None)
            response, _ = await self._forward_unary("ModelMetadata", request, pick, hints, context)
            return response
        except RouteError as err:
            await self.abort(context, err, request.name)
            raise  # unreachable: abort raises

    # ------------------------------------------------------------------ inference

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        started = self.clock()
        span = self.tracing.server_span("ModelInfer", context.invocation_metadata())
        hints: RouteHints | None = None
        pick: PickRequest | None = None
        code, route, tokens = grpc.StatusCode.UNKNOWN, "", 0
        try:
            hints = self.hints(context)
            gen = parse_generate(request, self.limits)
            pick = self.pick_request(gen.model, gen.version, hints, gen)
            release = await self.admission.admit(hints, pick)
            try:
                response, route = await self._forward_unary(
                    "ModelInfer", request, pick, hints, context, span
                )
            finally:
                release()
            code, tokens = grpc.StatusCode.OK, pick.max_tokens
            return response
        except RouteError as err:
            code = err.code
            await self.abort(context, err, request.model_name)
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if hints is not None:
                self.admission.record(
                    hints,
                    pick,
                    request.model_name,
                    route,
                    code,
                    started,
                    tokens,
                    tm.hex_trace_id(span) or trace_id(hints),
                )
            tenant = hints.tenant if hints else None
            self.tracing.end_server_span(span, tenant, request.model_name, route, code)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        started = self.clock()
        span = self.tracing.server_span("ModelStreamInfer", context.invocation_metadata())
        forward: StreamForward | None = None
        code = grpc.StatusCode.UNKNOWN
        try:
            forward = StreamForward(self, self.hints(context), context, span)
            await forward.run(request_iterator)
            code = grpc.StatusCode.OK
        except RouteError as err:
            code = err.code
            await context.abort(err.code, err.message, trailing_metadata=err.trailers)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if forward is not None:
                pick = forward.pick
                self.admission.record(
                    forward.hints,
                    pick,
                    pick.model if pick else "",
                    forward.route,
                    code,
                    started,
                    forward.responses,
                    tm.hex_trace_id(span) or trace_id(forward.hints),
                )
            self.tracing.end_server_span(
                span,
                forward.hints.tenant if forward else None,
                forward.pick.model if forward and forward.pick else "",
                forward.route if forward else "",
                code,
            )

    def child_metadata(
        self, hints: RouteHints, pick: PickRequest, lease: Lease, attempt: int, parent: Span
    ) -> list[tuple[str, str]]:
        """Downstream metadata carrying this tier's context: the attempt span's, or
        (sampled out) the server span's, so the tiers below keep the sampling decision."""
        metadata = self.downstream_metadata(hints, pick, attempt)
        return tm.inject_context(metadata, lease.span or parent)

    # ------------------------------------------------------------------ shared mechanics

    async def abort(self, context: grpc.aio.ServicerContext, err: RouteError, model: str) -> None:
        """End the call with ``err``, telling the tier above what capacity is left here."""
        hint = self.hint(model)
        trailers = (*err.trailers, (CAPACITY_HINT, hint)) if hint else err.trailers
        await context.abort(err.code, err.message, trailing_metadata=trailers)

    def hint(self, model: str) -> str | None:
        return self.hint_source(model)

    def hints(self, context: grpc.aio.ServicerContext) -> RouteHints:
        metadata = context.invocation_metadata()
        hints = parse_hints(metadata, trust_internal=self.spec.trust_internal)
        return self.admission.identify(metadata, hints)

    def pick_request(
        self, model: str, version: str, hints: RouteHints, gen: GenerateRequest | None
    ) -> PickRequest:
        if len(model) > MAX_NAME_CHARS:
            raise RouteError.invalid(f"model name is longer than {MAX_NAME_CHARS} characters")
        if model not in self.models:
            raise RouteError.not_found(
                f"model {model!r} is not served here; known models: {sorted(self.models)}"
            )
        blocks = hints.prefix_blocks
        if gen is not None and not blocks:
            # The edge hashes the prompt once; inner tiers reuse what it sent.
            blocks = tuple(prompt_block_hashes(gen.prompt, model=model, limit=MAX_CARRIED_BLOCKS))
        return PickRequest(
            model=model,
            version=version,
            origin=self.spec.resolve_origin(hints),
            session=hints.session,
            priority=hints.priority,
            prompt_tokens=gen.prompt_tokens if gen else 0,
            max_tokens=gen.max_tokens if gen else 0,
            tenant=hints.tenant,
            client_region=hints.client_region,
            allowed_regions=hints.allowed_regions,
            prefix_blocks=blocks,
        )

    def route_of(self, child: Child, child_trailers: Any) -> str:
        below = trailer(child_trailers, ROUTE) or child.name
        return f"{self.spec.route_prefix}/{below}" if self.spec.route_prefix else below

    @staticmethod
    def timeout(context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        if remaining is None:
            return None
        if remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline spent before forwarding")
        return float(remaining)

    def downstream_metadata(
        self, hints: RouteHints, pick: PickRequest, attempt: int
    ) -> list[tuple[str, str]]:
        return hints.downstream_metadata(pick.origin, hints.attempt + attempt, pick.prefix_blocks)

    async def next_lease(
        self,
        pick: PickRequest,
        attempts: Attempts,
        context: grpc.aio.ServicerContext,
        parent: Span = trace.INVALID_SPAN,
    ) -> Lease:
        """Reserve the child for the next attempt: after a back-off, inside the budget."""
        n = len(attempts.tried)
        if n:
            if n >= self.spec.max_attempts:
                raise attempts.error(self.children.kind, pick.model)
            # Failing over away from a dead child is not a retry storm: only retries
            # that go back to live children count against the budget.
            if not attempts.failures[-1].child_down:
                if not self.retry_budget.try_start_retry():
                    raise attempts.error(self.children.kind, pick.model)
                attempts.holding_retry = True
            await asyncio.sleep(backoff_delay_s(n, self.rng))
        started = self.tracing.decision_started(parent)
        try:
            lease = await self.balancer.acquire(pick, attempts.tried, self.timeout(context))
        except RouteError as err:
            self.tracing.record_decision(parent, started, code=err.code)
            if n and err.code == grpc.StatusCode.UNAVAILABLE:
                raise attempts.error(self.children.kind, pick.model) from None
            raise
        except asyncio.CancelledError:
            self.tracing.record_decision(parent, started, code=grpc.StatusCode.CANCELLED)
            raise
        self.tracing.record_decision(parent, started, lease)
        attempts.tried.append(lease.child.name)
        return lease

    def lease_timeout(self, lease: Lease, context: grpc.aio.ServicerContext) -> float | None:
        """The time left once a lease is held (the wait for it may have spent it all)."""
        try:
            return self.timeout(context)
        except RouteError:
            self.settle(lease, grpc.StatusCode.DEADLINE_EXCEEDED, ())
            raise

    def end_attempt(self, attempts: Attempts) -> None:
        if attempts.holding_retry:
            attempts.holding_retry = False
            self.retry_budget.retry_finished()

    def settle(self, lease: Lease, code: grpc.StatusCode, trailers: Any, detail: str = "") -> None:
        tokens = lease.max_tokens if code == grpc.StatusCode.OK else 0
        elapsed = self.clock() - lease.started_at
        span, lease.span = lease.span, None
        if span is not None:
            tm.end_span(span, code, detail, {tm.ACTUAL_S: elapsed})
        self.balancer.release(lease, Outcome(code, elapsed, tokens, trailers, detail))

    def failover_or_raise(self, lease: Lease, exc: grpc.aio.AioRpcError) -> Failover:
        """Settle a failed attempt; the Failover to record, or the RouteError to return."""
        trailers = exc.trailing_metadata()
        self.settle(lease, exc.code(), trailers, exc.details() or "")
        if exc.code() in self.spec.failover_codes:
            return Failover(
                lease.child.name,
                exc.code(),
                exc.details() or "",
                trailers,
                child_down=not lease.child.healthy,
            )
        raise RouteError(exc.code(), exc.details() or "", passable(trailers)) from None

    async def _forward_unary(
        self,
        method: str,
        request: Any,
        pick: PickRequest,
        hints: RouteHints,
        context: grpc.aio.ServicerContext,
        span: Span = trace.INVALID_SPAN,
    ) -> tuple[Any, str]:
        """The child's response and the route it took."""
        attempts = Attempts()
        self.retry_budget.request_started()
        try:
            while True:
                try:
                    lease = await self.next_lease(pick, attempts, context, span)
                    n = len(attempts.tried) - 1
                    self.tracing.begin_attempt(method, lease, hints.attempt + n, span)
                    timeout = self.lease_timeout(lease, context)
                    assert lease.child.stub is not None
                    call = getattr(lease.child.stub, method)(
                        request,
                        metadata=self.child_metadata(hints, pick, lease, n, span),
                        timeout=timeout,
                    )
                    try:
                        response = await call
                        trailers = await call.trailing_metadata()
                    except grpc.aio.AioRpcError as exc:
                        attempts.failures.append(self.failover_or_raise(lease, exc))
                        continue
                    except asyncio.CancelledError:
                        self.settle(lease, grpc.StatusCode.CANCELLED, ())
                        raise
                    except Exception as exc:  # never leak a lease, whatever went wrong
                        self.settle(lease, grpc.StatusCode.INTERNAL, (), repr(exc))
                        raise RouteError(
                            grpc.StatusCode.INTERNAL, f"forwarding failed: {exc!r}"
                        ) from None
                    self.settle(lease, grpc.StatusCode.OK, trailers)
                    route = self.route_of(lease.child, trailers)
                    context.set_trailing_metadata(
                        with_route(trailers, route, self.hint(pick.model))
                    )
                    return response, route
                finally:
                    self.end_attempt(attempts)
        finally:
            self.retry_budget.request_finished()


def trace_id(hints: RouteHints) -> str:
    """The W3C trace id of the request's ``traceparent``, if it sent one."""
    for key, value in hints.passed_down:
        if key == "traceparent":
            parts = value.split("-")
            return parts[1] if len(parts) >= 2 else ""
    return ""
