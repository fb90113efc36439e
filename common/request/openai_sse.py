"""One ``stream: true`` OpenAI request: V2 stream responses out as server-sent events.

The request runs as a one-request stream through the proxy
(``InferenceProxy.stream_one``); each response the GPU sends up (one per token)
is written as a ``data: {…}`` chunk the moment it arrives. The HTTP status is
chosen as late as possible: the response (200, ``text/event-stream``) starts
with the first chunk, so every refusal before it — key, quota, unknown model,
no capacity — is a plain OpenAI error with its own status (429 with
``Retry-After``), and a failover below stays invisible. A failure after the
first chunk can only be an event, ``data: {"error": {…}}``, then
``data: [DONE]`` (what vLLM sends; the ``openai`` client raises it as an
``APIError``). A good stream ends with a chunk carrying ``finish_reason``, with
``stream_options.include_usage`` a chunk carrying only ``usage``, then
``data: [DONE]``.

A client that goes away mid-stream: aiohttp cancels the handler (the edge runs
it with ``handler_cancellation``), or the next write fails (``CallerGone``); either
way the stream relay cancels the request, which releases its GPU slot and its
tenant's concurrency slot and cancels the generation below, and its usage
record is written with what it got (CANCELLED).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from aiohttp import web

from common.gen.inference import grpc_service_pb2 as pb
from common.request.call import STREAM_METHOD, CallInterceptor
from common.request.openai_call import CallAborted, CallerGone, HttpCallContext
from common.request.openai_json import (
    SSE_DONE,
    Answer,
    OpenAIError,
    Usage,
    finish_reason,
    grpc_error,
    sse,
)
from common.request.openai_v2 import to_infer_request
from common.request.stream_request import status_of
from common.request.tokens import TokenCount
from common.request.v2 import response_text

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# InferenceProxy.stream_one: one request as a stream whose failure is the call's status.
StreamOne = Callable[[pb.ModelInferRequest, HttpCallContext], Awaitable[None]]


class SseStream:
    """Writes one request's stream to its HTTP caller (see the module docstring)."""

    def __init__(self, http: web.Request, answer: Answer) -> None:
        self.http = http
        self.answer = answer
        self.response: web.StreamResponse | None = None
        self.count = TokenCount()
        self.tokens = 0
        # A GPU's error_message for the request (it then ends without a status).
        self.error: OpenAIError | None = None

    async def serve(
        self, proxy_stream: StreamOne, calls: CallInterceptor, ctx: HttpCallContext
    ) -> web.StreamResponse:
        """Run the request and write its events; the HTTP response to return."""
        infer = to_infer_request(self.answer.request, self.answer.id)
        failure: OpenAIError | None = None
        try:
            handling = ctx.bounded(proxy_stream(infer, ctx))
            await calls.observe(STREAM_METHOD, ctx.invocation_metadata(), ctx, handling)
        except CallAborted as err:
            failure = grpc_error(err.code, err.details, err.trailers)
        failure = failure or self.error
        if self.response is None and failure is not None:
            return error_response(failure)  # nothing sent yet: a status of its own
        with contextlib.suppress(CallerGone):
            await self._last(sse(failure.body()) if failure is not None else self._finish())
        return self.response or web.Response(status=499)

    async def write(self, message: pb.ModelStreamInferResponse) -> None:
        """``context.write``: one V2 stream response, as one SSE chunk."""
        if message.error_message:  # the stream ends next: ``serve`` says it, once
            code, detail = status_of(message.error_message)
            self.error = grpc_error(code, detail)
            return
        infer = message.infer_response
        self.count.add(infer)
        text = response_text(infer)
        if not len(infer.outputs):
            return  # a bare final marker carries no text
        self.tokens += 1
        await self._send(self.answer.chunk(text, first=self.response is None))

    def usage(self) -> Usage:
        """The GPU's counts, else the estimates: prompt words, token responses."""
        prompt = self.count.prompt
        if prompt is None:
            prompt = len(self.answer.request.prompt.split())
        completion = self.count.completion
        return Usage(prompt, self.tokens if completion is None else completion)

    def _finish(self) -> bytes:
        """The events that end a good stream: finish_reason, usage if asked."""
        usage = self.usage()
        events = self.answer.chunk("", finish_reason(self.answer.request, usage))
        if self.answer.request.include_usage:
            events += self.answer.usage_chunk(usage)
        return events

    async def _last(self, events: bytes) -> None:
        await self._send(events + SSE_DONE)
        assert self.response is not None
        try:
            await self.response.write_eof()
        except (OSError, RuntimeError) as exc:
            raise CallerGone(f"the HTTP client went away: {exc}") from None

    async def _send(self, data: bytes) -> None:
        try:
            if self.response is None:
                response = web.StreamResponse(status=200, headers=SSE_HEADERS)
                await response.prepare(self.http)
                self.response = response
            await self.response.write(data)
        except (OSError, RuntimeError) as exc:  # the transport closed under us
            raise CallerGone(f"the HTTP client went away: {exc}") from None


def error_response(error: OpenAIError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=dict(error.headers))
