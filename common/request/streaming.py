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
* responses waiting to be written: a request keeps reading its child while the
  caller does not read, merging the text it holds, so its child's answer ends (and
  its lease, the GPU slot, goes back) in the answer's own time; what it holds is
  bounded (``coalesce.MAX_HELD`` responses, ``coalesce.MAX_HELD_TEXT_BYTES`` of
  text: a whole answer at the longest ``max_tokens``), beyond which it stops reading
  its child and gRPC flow control holds the rest back there.

**Writing.** One writer task per stream writes every response, so a request never
waits for a write before reading its child's next response: what arrives while the
writer is busy waits in the request's ``Outbox`` and goes up as one message
(``common.request.coalesce``). With ``coalesce_s`` (``limits.stream_coalesce_ms``, at
the tier whose children are the GPUs) the writer also holds a request's first
waiting response that long before writing what has gathered, unless the request has
ended or that response is its first token (which goes at once). The write timeout is
one timer per stream, re-armed only when it fires: no per-message timer, lock or task.
A request's record waits until what it put out was written, or failed to be: it says
OK only for an answer that reached the caller whole (``common.request.stream_request``).

A request that fails — refused at parse, place or admission, or failing after it
committed — gets an ``error_message`` naming its request id and the stream goes
on, as in Triton. A stream the tier above opened for one request
(``x-meridian-single-request``) ends with that request's status instead, so the
tier above can fail over on it as on a unary call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from functools import partial

import grpc

from common.basics.errors import RouteError
from common.config.access import Limits
from common.gen.inference import grpc_service_pb2 as pb
from common.request.call import CallRecord
from common.request.coalesce import Outbox
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
    """One caller's stream: a reader task takes its requests, one task serves each,
    one writer task writes their responses (see the module docstring).

    ``relay`` returns when the caller has half-closed, every request has ended and
    everything they put out was written, or raises the RouteError the stream must end
    with (a write or idle timeout, or a single-request stream's failure); either way
    nothing it started outlives it.
    """

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        record: CallRecord,
        path: RequestPath,
        limits: Limits,
        *,
        single: bool = False,
        coalesce_s: float = 0.0,
    ) -> None:
        self.context = context
        self.record = record
        self.path = path
        self.single = single
        self.coalesce_s = coalesce_s
        self.write_timeout_s = limits.stream_write_timeout_s
        self.idle_timeout_s = limits.stream_idle_timeout_s
        # One permit per request in flight: the reader takes one before reading.
        self.slots = asyncio.Semaphore(limits.max_stream_requests_in_flight)
        self.in_flight: dict[asyncio.Task[None], Outbox] = {}
        self.reading = True
        self.failure: RouteError | None = None
        self.ended = asyncio.Event()
        self._idle: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        # Outboxes holding responses, oldest first; the writer's wake-up while it waits.
        self._queue: deque[Outbox] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._writing_since: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    async def relay(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        """Relay the whole stream (see the class docstring)."""
        reader = asyncio.create_task(self._read(requests))
        writer = asyncio.create_task(self._write_loop())
        self._idle_from_now()
        try:
            await self.ended.wait()
        finally:
            self.ended.set()  # from here on nothing starts an idle clock or writes
            self._not_idle()
            if self._watchdog is not None:
                self._watchdog.cancel()
            tasks = [reader, writer, *self.in_flight]
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
        box = Outbox(self._ready)
        one = StreamRequest(request, self.record, self.path, box)
        refused = partial(self._refused, box)
        flush = partial(self._flush, box)
        task = asyncio.create_task(serve_request(one, refused, self._ending_code, flush))
        self.in_flight[task] = box
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        box = self.in_flight.pop(task, None)
        self.slots.release()
        if box is not None and box.parts:
            box.closing = True  # what it holds goes now, without a window
            self._wake_writer()
        self._end_if_done()

    def _end_if_done(self) -> None:
        """Nothing in flight or left to write: the stream is over once the caller
        half-closed, else idle."""
        if self.in_flight or self._queue or self._writing_since is not None:
            return
        if self.ended.is_set():
            return
        if self.reading:
            self._idle_from_now()
        else:
            self.ended.set()

    async def _refused(self, box: Outbox, request: pb.ModelInferRequest, err: RouteError) -> None:
        if self.single:
            # The tier above learns the status and may fail over; what the request
            # already put out goes first (the status follows its responses).
            await box.wait_drained()
            self._fail(err)
        else:
            await box.put(error_response(request, err))

    async def _flush(self, box: Outbox) -> None:
        """Until what ``box`` holds is written, or failed to be (``box.lost``): it goes
        now, without a window. A request's record waits for it (``serve_request``)."""
        if not box.drained:
            box.closing = True
            self._wake_writer()
            await box.wait_drained()

    def _ending_code(self) -> grpc.StatusCode:
        """The status of a request cut short because its stream is ending."""
        return self.failure.code if self.failure is not None else self._caller_gone()

    def _caller_gone(self) -> grpc.StatusCode:
        """Why the call ended under the relay: DEADLINE_EXCEEDED once the caller's
        deadline passed (what the caller got), else CANCELLED (the caller went away)."""
        left = self.context.time_remaining()
        spent = left is not None and left <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if spent else grpc.StatusCode.CANCELLED

    def _fail(self, err: RouteError) -> None:
        """End the stream with ``err``: every request in flight is cancelled now."""
        if self.ended.is_set():
            return
        self.failure = err
        self.ended.set()
        for task in self.in_flight:
            task.cancel()

    # ------------------------------------------------------------------ writing

    def _ready(self, box: Outbox) -> None:
        """``box`` holds a response again: queue it for the writer."""
        box.since = self._loop.time()
        self._queue.append(box)
        self._wake_writer()

    def _wake_writer(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write_loop(self) -> None:
        """Write what the outboxes hold, oldest first, until the stream ends."""
        queue = self._queue
        while not self.ended.is_set():
            if not queue:
                self._end_if_done()
                await self._sleep(None)
                continue
            box = queue[0]
            # The window holds what follows a request's first token, never the first:
            # the time to first token is not traded for CPU.
            if self.coalesce_s and box.responses and not box.closing:
                wait = box.since + self.coalesce_s - self._loop.time()
                if wait > 0:
                    await self._sleep(wait)
                    continue
            queue.popleft()
            response = box.take()
            if box.parts:  # something it could not merge: its turn comes again
                self._ready(box)
            box.taken(await self._write(response))

    async def _sleep(self, seconds: float | None) -> None:
        """Until ``_wake_writer`` (or ``seconds``, when given)."""
        self._wake = wake = self._loop.create_future()
        timer = None if seconds is None else self._loop.call_later(seconds, _settle, wake)
        try:
            await wake
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()

    async def _write(self, response: pb.ModelStreamInferResponse) -> bool:
        """Write one response to the caller: whether it was; a failure to write ends the
        stream."""
        self._writing_since = self._loop.time()
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self.write_timeout_s, self._check_write)
        try:
            await self.context.write(response)
            return True
        except (grpc.RpcError, grpc.aio.BaseError, asyncio.InvalidStateError, RuntimeError) as exc:
            # The call is already over (the caller went away mid-write; grpc.aio may say
            # so with an InternalError): the caller's doing, never the child's.
            failed = f"writing to the caller failed: {exc}"
            self._fail(RouteError(self._caller_gone(), failed))
            return False
        finally:
            self._writing_since = None

    def _check_write(self) -> None:
        """The write timeout's timer: a write still under way after the timeout ends
        the stream; else it is armed again for the write under way, if any."""
        self._watchdog = None
        since = self._writing_since
        if since is None or self.ended.is_set():
            return
        left = since + self.write_timeout_s - self._loop.time()
        if left > 0:
            self._watchdog = self._loop.call_later(left, self._check_write)
            return
        self._fail(
            RouteError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"caller stopped reading: a response waited {self.write_timeout_s:g} s "
                "to be written (limits.stream_write_timeout_s); the stream's requests "
                "in flight were cancelled",
            )
        )

    # ------------------------------------------------------------------ idle

    def _idle_from_now(self) -> None:
        self._not_idle()
        self._idle = self._loop.call_later(self.idle_timeout_s, self._idle_expired)

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


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
