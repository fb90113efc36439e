"""Relaying a caller's ModelStreamInfer through one tier: every request on its own.

A stream may carry any number of requests. Each is served on its own
(``common.request.stream_request``: placed, admitted, billed and forwarded on a
child stream of its own, with its own lease and failover); their responses are
written back to the caller as they arrive, multiplexed (the caller tells them apart
by request id). What one stream may hold is bounded (``common.config.access.Limits``):

* requests in flight: at most ``max_stream_requests_in_flight``; beyond that the
  relay stops reading the caller's requests until one finishes, so gRPC flow
  control holds the caller back (nothing is lost, nothing refused);
* a caller that stops reading: a response not written within
  ``stream_write_timeout_s`` ends the stream with DEADLINE_EXCEEDED ("caller
  stopped reading"), cancelling every request in flight, so their leases (GPU
  slots) go back and their child calls, down to the GPU, are cancelled;
* a stream with nothing in flight and no new request for ``stream_idle_timeout_s``
  ends with DEADLINE_EXCEEDED as well;
* responses waiting to be written: one per request in flight (each request waits
  for its write before reading its child's next response; gRPC flow control holds
  the rest back in the child, and the emulated GPU's bounded queue holds its
  generation back).

A request that fails — refused at parse, place or admission, or failing after it
committed — gets an ``error_message`` naming its request id and the stream goes
on, as in Triton. A stream the tier above opened for one request
(``x-meridian-single-request``) ends with that request's status instead, so the
tier above can fail over on it as on a unary call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from common.basics.errors import RouteError
from common.config.access import Limits
from common.gen.inference import grpc_service_pb2 as pb
from common.request.call import CallRecord
from common.request.stream_request import (
    Release,
    RequestPath,
    StreamRequest,
    error_response,
    no_release,
    serve_request,
)

# Release and no_release are the admission's vocabulary (common.tenancy.admission).
__all__ = ["Release", "RequestPath", "StreamRelay", "no_release"]


class StreamRelay:
    """One caller's stream: a reader task takes its requests, one task serves each.

    ``relay`` returns when the caller has half-closed and every request has ended,
    or raises the RouteError the stream must end with (a write or idle timeout, or
    a single-request stream's failure); either way nothing it started outlives it.
    """

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        record: CallRecord,
        path: RequestPath,
        limits: Limits,
        *,
        single: bool = False,
    ) -> None:
        self.context = context
        self.record = record
        self.path = path
        self.single = single
        self.write_timeout_s = limits.stream_write_timeout_s
        self.idle_timeout_s = limits.stream_idle_timeout_s
        # One permit per request in flight: the reader takes one before reading.
        self.slots = asyncio.Semaphore(limits.max_stream_requests_in_flight)
        self.in_flight: set[asyncio.Task[None]] = set()
        self.reading = True
        self.failure: RouteError | None = None
        self.ended = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._idle: asyncio.TimerHandle | None = None

    async def relay(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        """Relay the whole stream (see the class docstring)."""
        reader = asyncio.create_task(self._read(requests))
        self._idle_from_now()
        try:
            await self.ended.wait()
        finally:
            self.ended.set()  # from here on nothing starts an idle clock or writes
            self._not_idle()
            tasks = [reader, *self.in_flight]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.failure is not None:
            raise self.failure

    async def _read(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        iterator = aiter(requests)
        try:
            while True:
                # Backpressure: with every permit taken, the caller's next request stays
                # unread (in gRPC's flow-control window) until one of ours finishes.
                await self.slots.acquire()
                try:
                    request = await anext(iterator)
                except BaseException:
                    self.slots.release()
                    raise
                self._not_idle()
                self._start(request)
        except StopAsyncIteration:
            pass
        finally:
            self.reading = False
            self._end_if_done()

    def _start(self, request: pb.ModelInferRequest) -> None:
        if not self.record.model:
            self.record.model = request.model_name
        one = StreamRequest(request, self.record, self.path, self.write)
        task = asyncio.create_task(serve_request(one, self._refused, self._ending_code))
        self.in_flight.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.in_flight.discard(task)
        self.slots.release()
        self._end_if_done()

    def _end_if_done(self) -> None:
        """Nothing in flight: the stream is over once the caller half-closed, else idle."""
        if self.in_flight or self.ended.is_set():
            return
        if self.reading:
            self._idle_from_now()
        else:
            self.ended.set()

    async def _refused(self, request: pb.ModelInferRequest, err: RouteError) -> None:
        if self.single:
            self._fail(err)  # the tier above learns the status and may fail over
        else:
            await self.write(error_response(request, err))

    def _ending_code(self) -> grpc.StatusCode:
        """The status of a request cut short because its stream is ending."""
        return self.failure.code if self.failure is not None else grpc.StatusCode.CANCELLED

    def _fail(self, err: RouteError) -> None:
        """End the stream with ``err``: every request in flight is cancelled now."""
        if self.ended.is_set():
            return
        self.failure = err
        self.ended.set()
        for task in self.in_flight:
            task.cancel()

    # ------------------------------------------------------------------ writing

    async def write(self, response: pb.ModelStreamInferResponse) -> None:
        """Write one response to the caller, or end the stream if it cannot be written
        within the write timeout (then the calling request's task is cancelled)."""
        if self.ended.is_set():
            return  # the stream is ending; this request's task is being cancelled
        try:
            async with asyncio.timeout(self.write_timeout_s):
                async with self._write_lock:
                    await self.context.write(response)
        except TimeoutError:
            self._fail(
                RouteError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"caller stopped reading: a response waited {self.write_timeout_s:g} s "
                    "to be written (limits.stream_write_timeout_s); the stream's requests "
                    "in flight were cancelled",
                )
            )
        except (grpc.RpcError, grpc.aio.BaseError, asyncio.InvalidStateError, RuntimeError) as exc:
            # The call is already over (the caller went away mid-write; grpc.aio may say
            # so with an InternalError): the caller's doing, never the child's.
            failed = f"writing to the caller failed: {exc}"
            self._fail(RouteError(grpc.StatusCode.CANCELLED, failed))

    # ------------------------------------------------------------------ idle

    def _idle_from_now(self) -> None:
        self._not_idle()
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self.idle_timeout_s, self._idle_expired)

    def _not_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_expired(self) -> None:
        self._idle = None
        self._fail(
            RouteError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"stream idle: no request in flight for {self.idle_timeout_s:g} s "
                "(limits.stream_idle_timeout_s); open a new stream when there is more to send",
            )
        )
