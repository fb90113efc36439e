"""One inference call as the cross-cutting concerns see it, and the interceptor that shares it.

Tracing, metrics and usage records are not the request path's business, but each
needs to know what the path found out: who the tenant is (only the edge's proxy
knows, after authentication), which model, where it ran, how many tokens. The
proxy writes that into the call's ``CallRecord``; ``CallInterceptor`` creates the
record before the handler runs and hands it to each ``CallObserver`` as the call
starts and once it has ended, with the final status.

The record travels in a ``ContextVar``: grpc.aio runs each call in a task of its
own, so the variable is per call, and tasks the handler starts (a stream's client
reader) see the same record.

A stream carries requests, and every request counts on its own: the stream
relay (``common.request.streaming``) gives each one a record of its own
(``CallRecord.for_request``, ``stream`` set to the stream's record) and, once the
request has ended, hands it to the observers' ``call_ended``
(``CallRecord.request_ended``). Such a record never gets ``call_started`` (the
stream's server span is the trace's; the request's pick and attempt spans hang
under it). The stream's own record still starts and ends with the call, but it
``carries_requests``: usage is billed, and requests counted, per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from common.request.abort import abort_call
from common.request.routing import RouteHints

STREAM_METHOD = "ModelStreamInfer"
INFER_METHODS = frozenset({"ModelInfer", STREAM_METHOD})


def _nobody(request: CallRecord) -> None:
    """Where a stream's finished requests go when no interceptor observes the call."""
    return None


@dataclass(slots=True)
class CallRecord:
    """What one inference call did, filled in as the request path learns it."""

    method: str
    metadata: Iterable[tuple[str, Any]]
    started: float
    # The caller's hints once read and authenticated (None: the call failed before).
    hints: RouteHints | None = None
    model: str = ""
    route: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The request's max_tokens (a stream's own record: 0, its requests have their own).
    max_tokens: int = 0
    # True once the GPU server's own counts replaced the estimates above (the
    # estimate is prompt words and max_tokens until the answer says otherwise).
    tokens_reported: bool = False
    # Tokens the edge's tokens_per_min quota took at admission (prompt words +
    # max_tokens; 0: none), settled against the counts above when the call ends.
    tokens_charged: int = 0
    # Seconds from ``started`` to the first response sent back (None: none was sent):
    # a unary call's answer, a stream request's first response carrying output.
    first_response_s: float | None = None
    # A stream's request that asked for token streaming (its responses come token by
    # token, so the time per output token can be measured).
    streamed: bool = False
    # The tier's server span (the tracing observer's); decisions and attempts nest under it.
    span: Span = trace.INVALID_SPAN
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    detail: str = ""
    # The stream this is one request of (None: a unary call, or a stream's own record).
    stream: CallRecord | None = None
    # A stream's requests that have ended, and where each one's record goes (the
    # interceptor's observers).
    requests: int = 0
    report: Callable[[CallRecord], None] = _nobody

    @property
    def tenant(self) -> str:
        return self.hints.tenant if self.hints is not None else ""

    @property
    def carries_requests(self) -> bool:
        """A stream's own record: its requests are recorded (billed, counted) one by one."""
        return self.method == STREAM_METHOD and self.stream is None

    def for_request(self) -> CallRecord:
        """A record for one request of this stream, started now."""
        return CallRecord(
            self.method, self.metadata, time.monotonic(), hints=self.hints, stream=self
        )

    def request_ended(self, request: CallRecord) -> None:
        """One request of this stream has ended (its code set): count it, report it."""
        self.requests += 1
        self.prompt_tokens += request.prompt_tokens
        self.completion_tokens += request.completion_tokens
        if request.route:
            self.route = request.route
        self.report(request)

    @property
    def trace_id(self) -> str:
        """The call's W3C trace id: its server span's, else the caller's ``traceparent``'s
        (a stream's request: its stream's)."""
        if self.stream is not None:
            return self.stream.trace_id
        ctx = self.span.get_span_context()
        if ctx.is_valid:
            return format(ctx.trace_id, "032x")
        for key, value in self.hints.passed_down if self.hints is not None else ():
            if key == "traceparent":
                parts = value.split("-")
                return parts[1] if len(parts) >= 2 else ""
        return ""

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


CURRENT_CALL: ContextVar[CallRecord | None] = ContextVar("meridian_call", default=None)


def current_call(method: str, metadata: Iterable[tuple[str, Any]] | None) -> CallRecord:
    """The record ``CallInterceptor`` made for this call, or a fresh one when the
    proxy serves without it (then nobody observes the call)."""
    return CURRENT_CALL.get() or CallRecord(method, metadata or (), time.monotonic())


def call_of(method: str, context: Any) -> CallRecord:
    """``current_call`` with the metadata of ``context`` (the call's), read only when
    no interceptor made the record (each read builds it anew)."""
    call = CURRENT_CALL.get()
    return call if call is not None else current_call(method, context.invocation_metadata())


class CallObserver(Protocol):
    """A cross-cutting concern: sees each inference call start and end."""

    def call_started(self, call: CallRecord) -> None: ...

    def call_ended(self, call: CallRecord) -> None: ...


def final_status(context: Any, exc: BaseException | None) -> tuple[grpc.StatusCode, str]:
    """The status a handler ended with: what ``context`` says, else OK / CANCELLED / UNKNOWN."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code, context.details() or ""
    if isinstance(code, int):
        for member in grpc.StatusCode:
            if member.value[0] == code:
                return member, context.details() or ""
    if exc is None:
        return grpc.StatusCode.OK, ""
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, ""
    return grpc.StatusCode.UNKNOWN, str(exc)


async def in_time(handling: Awaitable[Any], context: grpc.aio.ServicerContext) -> Any:
    """A gRPC unary handler's answer, unless it came after the caller's deadline.

    gRPC's core answers DEADLINE_EXCEEDED itself once the deadline passes and drops a
    later answer, but grpc.aio cancels the handler only if it is awaiting then: one
    whose event loop was busy at that moment (a loaded tier) returns its answer as if
    in time, and its observers would record OK, a usage record billing an answer the
    caller never got. Such an answer ends the call as DEADLINE_EXCEEDED instead
    (``abort_call``, quietly), which is what the caller saw."""
    response = await handling
    left = context.time_remaining()
    if left is not None and left <= 0:
        await abort_call(
            context, grpc.StatusCode.DEADLINE_EXCEEDED, "answered after the caller's deadline"
        )
    return response


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Wraps ModelInfer and ModelStreamInfer in one ``CallRecord`` shared by ``observers``:
    started in their order, ended in reverse (the first to start is the last to end, so
    the tracing observer, first, still has its span while the others end). A stream's
    requests are ended the same way as each finishes. Other methods pass untouched."""

    def __init__(self, observers: Sequence[CallObserver]) -> None:
        self.observers = tuple(observers)
        # The observed handler of each method, built at its first call, kept while the
        # handler below it stays the same object (the servicer's, or ParentOnly's own).
        self._observed: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        path = handler_call_details.method
        kept = self._observed.get(path)
        if kept is not None and kept[0] is handler:
            return kept[1]
        method = path.rpartition("/")[2]
        if handler is None or method not in INFER_METHODS or not self.observers:
            return handler
        observed = self._observing(method, handler)
        if len(self._observed) < 16:  # the two inference methods, whatever the path
            self._observed[path] = (handler, observed)
        return observed

    def _observing(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` run as observed calls of ``method`` (the caller's metadata read
        from each call's context: the same the call details carry)."""
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def observed_unary(request: Any, context: Any) -> Any:
                metadata = context.invocation_metadata() or ()
                answering = in_time(unary(request, context), context)
                return await self.observe(method, metadata, context, answering)

            return grpc.unary_unary_rpc_method_handler(
                observed_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            stream = handler.stream_stream

            async def observed_stream(requests: AsyncIterator[Any], context: Any) -> Any:
                metadata = context.invocation_metadata() or ()
                return await self.observe(method, metadata, context, stream(requests, context))

            return grpc.stream_stream_rpc_method_handler(
                observed_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    async def observe(
        self,
        method: str,
        metadata: Iterable[tuple[str, Any]],
        context: Any,
        handling: Awaitable[Any],
    ) -> Any:
        """Run ``handling`` (a handler of ``method`` on ``context``) as one observed call.
        Another front end on the same proxy (the OpenAI edge, ``common.request.openai_http``)
        calls it too, so its calls are traced, counted and billed like gRPC ones."""
        call = CallRecord(method, metadata, time.monotonic(), report=self._ended)
        token = CURRENT_CALL.set(call)
        for observer in self.observers:
            observer.call_started(call)
        failure: BaseException | None = None
        try:
            response = await handling
            if method != STREAM_METHOD:  # the answer goes back now: the first response
                call.first_response_s = call.elapsed_s
            return response
        except BaseException as exc:
            failure = exc
            raise
        finally:
            CURRENT_CALL.reset(token)
            call.code, call.detail = final_status(context, failure)
            # The error's traceback holds this frame: kept in it, the two would make a
            # cycle per failed call that only the cyclic GC frees.
            failure = None
            self._ended(call)

    def _ended(self, call: CallRecord) -> None:
        for observer in reversed(self.observers):
            observer.call_ended(call)
