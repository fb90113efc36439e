"""A call that came over HTTP, as the proxy core sees a gRPC call.

The OpenAI edge runs its requests through the tier's own ``InferenceProxy`` in
process: no second router, no loopback gRPC hop. The proxy reads the caller's
metadata, its deadline, and ends a failed call with ``context.abort``; on a
stream it writes each response with ``context.write``. ``HttpCallContext`` is
that part of ``grpc.aio.ServicerContext`` for an HTTP request:

* metadata: the request's ``authorization``, ``x-meridian-*``, ``traceparent``
  and ``tracestate`` headers (``call_metadata``), so tenants, keys and routing
  hints are checked exactly as for gRPC;
* the deadline: the edge's ``openai_timeout_s`` (HTTP callers send none);
  ``bounded`` ends a call still running then with DEADLINE_EXCEEDED;
* ``abort`` raises ``CallAborted`` carrying the status and trailers (such as
  ``retry-after-ms``), which the edge turns into an OpenAI error;
* ``write`` hands a stream response to the edge's SSE writer; a client that went
  away makes it raise ``CallerGone`` (a RuntimeError, which the stream relay takes
  as the caller's doing: it cancels the request down to the GPU).

Whatever a gRPC-only part of the interface would need (peers, compression,
reading a request stream) is refused with NotImplementedError: the proxy does not
use it for these calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from common.gen.inference import grpc_service_pb2 as pb

T = TypeVar("T")
Write = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]
AUTHORIZATION = "authorization"
FORWARDED_HEADERS = frozenset({AUTHORIZATION, "traceparent", "tracestate"})
MERIDIAN_PREFIX = "x-meridian-"
# How long after the deadline the edge cancels a call that the deadline did not end.
BACKSTOP_S = 0.5


class CallAborted(Exception):
    """The proxy ended the call with a status (``context.abort``)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailers = tuple(trailers)


class CallerGone(RuntimeError):
    """The HTTP client went away while a response was being written."""


def call_metadata(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The headers the proxy reads, as gRPC metadata (lower-case keys)."""
    out = []
    for key, value in headers.items():
        name = key.lower()
        if name in FORWARDED_HEADERS or name.startswith(MERIDIAN_PREFIX):
            out.append((name, value))
    return tuple(out)


async def _no_writer(response: pb.ModelStreamInferResponse) -> None:
    raise CallerGone("this call has no stream to write to")


class HttpCallContext(grpc.aio.ServicerContext):
    """The servicer context of one HTTP call (see the module docstring)."""

    def __init__(
        self,
        metadata: Iterable[tuple[str, str]],
        timeout_s: float | None,
        *,
        write: Write = _no_writer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metadata = tuple(metadata)
        self._clock = clock
        self.timeout_s = timeout_s
        self._deadline = None if timeout_s is None else clock() + timeout_s
        self._write = write
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailers: tuple[tuple[str, str], ...] = ()

    # ------------------------------------------------------------------ what the proxy uses

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._clock())

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        self.trailers = tuple((k, v) for k, v in trailing_metadata if isinstance(v, str))

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.trailers

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        self._code, self._details = code, details
        self.set_trailing_metadata(trailing_metadata)
        raise CallAborted(code, details, self.trailers)

    async def abort_with_status(self, status: Any) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)
        raise AssertionError("unreachable")  # pragma: no cover

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    async def write(self, message: Any) -> None:
        await self._write(message)

    def stream_to(self, write: Write) -> None:
        """Where ``write`` sends the stream's responses (the edge's SSE writer)."""
        self._write = write

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}  # no TLS peer: HTTP callers authenticate with their API key

    async def bounded(self, handling: Awaitable[T]) -> T:
        """``handling`` within the deadline; past it, DEADLINE_EXCEEDED (CallAborted).

        The proxy passes the time left to the tier below as the gRPC deadline of each
        attempt, so at the deadline the child call itself ends with DEADLINE_EXCEEDED
        and the request is recorded as such (a stream's request too). The edge's own
        clock is a backstop ``BACKSTOP_S`` later, for anything that did not end then;
        the proxy finding the deadline spent (``common.request.abort``: code set, then
        cancelled) is DEADLINE_EXCEEDED as well."""
        left = self.time_remaining()
        timeout = asyncio.timeout(None if left is None else left + BACKSTOP_S)
        try:
            async with timeout:
                return await handling
        except TimeoutError:
            if not timeout.expired():
                raise
            detail = (
                f"the request ran past openai_timeout_s ({self.timeout_s:g} s) and was "
                "cancelled; ask for fewer max_tokens or raise the timeout"
            )
            self._code, self._details = grpc.StatusCode.DEADLINE_EXCEEDED, detail
            raise CallAborted(grpc.StatusCode.DEADLINE_EXCEEDED, detail) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            spent = self._code == grpc.StatusCode.DEADLINE_EXCEEDED
            if spent and task is not None and not task.cancelling():
                raise CallAborted(grpc.StatusCode.DEADLINE_EXCEEDED, self._details) from None
            raise

    # ------------------------------------------------------------------ gRPC only

    def _grpc_only(self, what: str) -> NoReturn:
        raise NotImplementedError(f"{what} has no meaning for a call that came over HTTP")

    async def read(self) -> Any:
        self._grpc_only("read")

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        self._grpc_only("send_initial_metadata")

    def set_compression(self, compression: Any) -> None:
        self._grpc_only("set_compression")

    def disable_next_message_compression(self) -> None:
        self._grpc_only("disable_next_message_compression")

    def peer(self) -> str:
        self._grpc_only("peer")

    def peer_identities(self) -> Iterable[bytes] | None:
        return None

    def peer_identity_key(self) -> str | None:
        return None
