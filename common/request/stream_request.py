"""One request inside a caller's ModelStreamInfer, served on its own.

Every request of a stream counts as if it had come alone: it is parsed, placed
(``PickRequest``), admitted through the tier's gate (rate, tokens, concurrency)
and forwarded through the tier's forwarding loop as an ``Attempt`` of its own —
its own child ``ModelStreamInfer`` call carrying just this request (then
half-closed), its own lease (at the local tier its own GPU slot, released when
that child stream ends), and its own failover while none of *its* responses went
back. Its responses are handed to the stream's writer as they arrive
(``common.request.streaming`` multiplexes them; ids are the caller's own).

**A child whose ModelStreamInfer is not Triton's** (MLServer's answers carry
``ModelInferResponse`` messages, which parse as a ``ModelStreamInferResponse``
whose ``error_message`` is the model's name, with unknown fields, or that do not
parse at all): learned at its first such answer, before anything is written back; that
request and every later one of a stream go to it as ``ModelInfer``, answered in
one stream response with the whole text (``Child.streams`` False, logged once as
``gpu_stream_unary``). The GPU ran that first request twice.

The child stream is marked ``x-meridian-single-request``, and a tier serving a
stream so marked ends it with the request's status instead of an
``error_message``: so a failure below reaches this tier as a status it can fail
over on (with its ``retry-after-ms``), exactly as for ModelInfer.

**Served** means answered whole *to the caller*: the request's record (its usage
record at the edge) is reported only once what it put out was written to the caller,
and says OK only if its answer was — the child's stream ended OK, or the child's
response marked ``triton_final_response`` (or the one whole answer) was relayed and
written. A child that fails after its final response (a tier that hung or died before
its trailers came) leaves the request served: no error follows the answer and the
record says OK; an answer the stream ended before writing (the caller's deadline, a
failed write) is not billed as served, even if the child finished it.

What the request cost goes into its own ``CallRecord`` (``CallRecord.for_request``):
the counts its GPU reported in the responses (``common.request.tokens``: the last
response's totals, or Triton's per-response counts summed), else the estimates: its
prompt in words, and as completion tokens the token responses it got when
streamed, or its ``max_tokens`` when it asked for ``stream: false``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet

from common.basics.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.request.attempt import Metadata
from common.request.call import STREAM_METHOD, CallRecord
from common.request.children import Child
from common.request.coalesce import Outbox
from common.request.pick import PickRequest
from common.request.routing import SINGLE_REQUEST
from common.request.tokens import TokenCount
from common.request.v2 import FINAL_RESPONSE, GenerateRequest, wants_stream

log = logging.getLogger(__name__)

# Gives back what admitting a request took (a tenant's concurrency slot).
Release = Callable[[], None]
Write = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]


def no_release() -> None:
    """The release of an admission that took nothing."""
    return None


@dataclass
class StreamRequestAttempt:
    """One request sent to one child on a stream of its own (``attempt.Attempt``)."""

    request: pb.ModelInferRequest
    write: Write
    method: str = STREAM_METHOD
    committed: bool = False
    # Responses carrying output (a bare final marker, as Triton may send, carries none).
    tokens: int = 0
    # The child's ``error_message`` for this request, if it sent one.
    error: str = ""
    # What the GPU reported of the request's tokens in the responses so far.
    count: TokenCount = field(default_factory=TokenCount)
    # When (monotonic) the first response carrying output was written back.
    first_response_at: float | None = None
    # The child's answer is whole: its final response (``triton_final_response``, or
    # the one answer of ModelInfer) was relayed. Nothing of the request's follows it.
    final: bool = False

    # Served by ModelInfer, in one response (a child whose stream is not Triton's).
    whole: bool = False
    # The child of the latest try: where the answer came from if that child then fails.
    child: Child | None = None
    # The last response relayed whose counts are not read yet (``settle_count``).
    _last: pb.ModelInferResponse | None = field(default=None, init=False, repr=False)

    @property
    def reported_completion(self) -> int | None:
        return self.count.completion

    async def send(
        self, child: Child, metadata: Metadata, timeout: float | None
    ) -> tuple[None, Any]:
        assert child.stub is not None
        self.child = child
        if not child.streams:
            return await self._send_unary(child, metadata, timeout)
        call = child.stub.ModelStreamInfer(
            iter((self.request,)),
            metadata=[*metadata, (SINGLE_REQUEST, "1")],
            timeout=timeout,
        )
        try:
            async for response in call:
                if not self.committed and _foreign(response):
                    break
                await self._relay(response)
            else:
                self.settle_count()
                return None, await call.trailing_metadata()
        finally:
            # Abandoned (the stream ended, a write timed out): the child, and the GPU
            # below it, stop too. A no-op once the call is done.
            call.cancel()
        _learn_unary(child)
        return await self._send_unary(child, metadata, timeout)

    async def _relay(self, response: pb.ModelStreamInferResponse) -> None:
        """Hand one response to the stream's writer, reading only what this tier needs:
        whether it is an error, whether it carries output; the counts are read once,
        from the last response (``settle_count``), unless it carries count tensors of
        its own (Triton's per-response ``num_output_tokens``, summed as they come)."""
        self.committed = True  # a response goes back: no failover from here on
        if response.error_message:
            self.error = response.error_message
        else:
            infer = response.infer_response
            outputs = len(infer.outputs)
            if outputs:
                self.tokens += 1
                if self.first_response_at is None:
                    self.first_response_at = time.monotonic()
            if outputs > 1:
                self.count.add(infer)
                self._last = None
            else:
                self._last = infer
            final = infer.parameters.get(FINAL_RESPONSE)
            if final is not None and final.bool_param:
                self.final = True
        await self.write(response)

    def settle_count(self) -> None:
        """Read the counts of the last response relayed (totals so far); idempotent."""
        if self._last is not None:
            self.count.add(self._last)
            self._last = None

    async def _send_unary(
        self, child: Child, metadata: Metadata, timeout: float | None
    ) -> tuple[None, Any]:
        """The request as ModelInfer, its answer as one stream response."""
        assert child.stub is not None
        call = child.stub.ModelInfer(self.request, metadata=metadata, timeout=timeout)
        response = await call
        self.whole = self.final = True
        await self._relay(pb.ModelStreamInferResponse(infer_response=response))
        self.settle_count()
        return None, await call.trailing_metadata()


def _foreign(response: pb.ModelStreamInferResponse | None) -> bool:
    """A stream answer that is no ModelStreamInferResponse: MLServer's ModelInferResponse
    (its model name read as ``error_message``, the rest unknown fields; None when it did
    not parse at all, which grpc.aio logs). Checked on a child's first answer only."""
    if response is None:
        return True
    return bool(response.error_message) and len(UnknownFieldSet(response)) > 0


def _learn_unary(child: Child) -> None:
    if child.streams:
        child.streams = False
        log.warning(
            "%s answers ModelStreamInfer with no ModelStreamInferResponse (not Triton's "
            "stream: MLServer?): its stream requests go as ModelInfer, one response each",
            child.name,
            extra={"event": "gpu_stream_unary", "child": child.name},
        )


@dataclass(frozen=True)
class RequestPath:
    """What the tier does for each request of a stream (``InferenceProxy`` provides it)."""

    parse: Callable[[pb.ModelInferRequest], GenerateRequest]
    pick: Callable[[GenerateRequest], PickRequest]
    admit: Callable[[PickRequest, CallRecord], Awaitable[Release]]
    # The route the request took (the forwarding loop; its trailers set on the call).
    forward: Callable[[StreamRequestAttempt, PickRequest], Awaitable[str]]
    # The route as far as this tier knows it through ``child`` alone (its trailers lost).
    hop: Callable[[Child], str]


def status_of(message: str) -> tuple[grpc.StatusCode, str]:
    """The status a child's ``error_message`` names (``"UNAVAILABLE: …"``), else UNKNOWN."""
    name, sep, rest = message.partition(": ")
    code = grpc.StatusCode.__members__.get(name) if sep else None
    return (code, rest) if code is not None else (grpc.StatusCode.UNKNOWN, message)


def error_response(request: pb.ModelInferRequest, err: RouteError) -> pb.ModelStreamInferResponse:
    """``err`` as a stream response; the V2 error response has no id field, so the
    message names the request, for a multiplexed stream's caller to tell which failed."""
    message = str(err)
    if request.id:
        message = f"{message} (request id {request.id[:64]!r})"
    return pb.ModelStreamInferResponse(error_message=message)


class StreamRequest:
    """One request of a stream: ``serve`` it, then ``settle`` its record."""

    def __init__(
        self, request: pb.ModelInferRequest, stream: CallRecord, path: RequestPath, box: Outbox
    ) -> None:
        self.request = request
        self.stream = stream
        self.record = stream.for_request()
        self.path = path
        # Where its responses wait for the stream's writer.
        self.box = box
        self.attempt = StreamRequestAttempt(request, box.put)
        self.pick: PickRequest | None = None

    async def serve(self) -> None:
        """Parse, place, admit, forward; raises RouteError when the request fails."""
        record = self.record
        record.model = self.request.model_name
        gen = self.path.parse(self.request)
        self.pick = pick = self.path.pick(gen)
        record.prompt_tokens, record.max_tokens = pick.prompt_tokens, pick.max_tokens
        release = await self.path.admit(pick, record)
        try:
            record.route = await self.path.forward(self.attempt, pick)
        finally:
            release()
        if self.attempt.error:
            record.code, record.detail = status_of(self.attempt.error)
        else:
            record.code, record.detail = grpc.StatusCode.OK, ""

    def settle(self, code: grpc.StatusCode, detail: str) -> None:
        self.record.code, self.record.detail = code, detail

    def served_anyway(self, detail: str) -> None:
        """Settle as OK a request whose answer was whole before its child failed or hung:
        the route is what this tier knows of it, the child's trailers never came."""
        self.settle(grpc.StatusCode.OK, detail)
        child = self.attempt.child
        if not self.record.route and child is not None:
            self.record.route = self.path.hop(child)

    @property
    def delivered(self) -> bool:
        """Its whole answer was written to the caller (see the module docstring)."""
        return self.attempt.final and self.box.drained and not self.box.lost

    def completion_tokens(self) -> int:
        """The estimate where the GPU reported nothing: token responses it got when
        streamed; ``max_tokens`` once answered with ``stream: false`` (one response
        carries the whole text)."""
        if wants_stream(self.request) and not self.attempt.whole:
            return self.attempt.tokens
        served = self.record.code == grpc.StatusCode.OK and self.attempt.tokens > 0
        return self.pick.max_tokens if served and self.pick is not None else 0

    def report(self) -> None:
        """Hand the finished request's record to the stream's observers."""
        record = self.record
        self.attempt.settle_count()
        self.attempt.count.fill(record, completion_estimate=self.completion_tokens())
        record.streamed = wants_stream(self.request) and not self.attempt.whole
        if self.attempt.first_response_at is not None:
            record.first_response_s = self.attempt.first_response_at - record.started
        self.stream.request_ended(record)


async def serve_request(
    one: StreamRequest,
    refused: Callable[[pb.ModelInferRequest, RouteError], Awaitable[None]],
    ending_code: Callable[[], grpc.StatusCode],
    flush: Callable[[], Awaitable[None]],
) -> None:
    """Serve one request of a stream and report its record, however it ends, once what
    it put out was written (``flush``): OK only when its answer reached the caller
    whole (see the module docstring). A failure before its final response goes to
    ``refused``; cancelled (the stream is ending) it ends with ``ending_code()`` unless
    its answer was already written."""
    try:
        try:
            await one.serve()
        except RouteError as err:
            if not one.attempt.final:
                raise
            # Its child failed after the final response (trailers lost to a hung or
            # dead tier): the answer is whole and on its way, the request served.
            one.served_anyway(f"answered before the child failed: {err.message}")
        await flush()
        if one.box.lost:
            one.settle(ending_code(), "the stream ended before the answer was written")
    except RouteError as err:
        one.settle(err.code, err.message)
        await refused(one.request, err)
    except asyncio.CancelledError:
        if one.delivered:
            one.served_anyway("")
        else:
            one.settle(ending_code(), "the stream ended before the request did")
        raise
    except Exception as exc:  # a bug must still answer the request, not drop it
        bug = RouteError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        one.settle(bug.code, bug.message)
        await refused(one.request, bug)
    finally:
        one.report()
