"""The OpenAI-compatible HTTP edge: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, served beside V2 gRPC by the edge tier on ``openai_listen``.

Nothing here routes. Each request becomes the V2 request of
``common.request.openai_v2`` and runs through the tier's own ``InferenceProxy``
in this process, inside the tier's ``CallInterceptor.observe``: the same
validation, tenants and keys (``Authorization: Bearer``), routing hints
(``x-meridian-*`` headers, the gRPC metadata names), quotas, forwarding and
failover, and the same traces, metrics and usage records as a gRPC call.
``stream: false`` runs as ModelInfer, ``stream: true`` as a one-request stream
written back as server-sent events (``common.request.openai_sse``).

What it checks before the proxy sees the request, in order: the key and the
routing headers (as the proxy will: OpenAI answers a bad key before a bad
body), the body's size (over ``limits.max_message_bytes / 2``: 413, so the V2
message carrying the body and its rendered prompt fits the tiers' message
limit), that it is JSON (400) and its fields (400 naming ``param``). These
refusals are observed calls too (counted, traced), except the 413, which like
gRPC's own oversized-message refusal never reaches the request path.

Errors are OpenAI's JSON shape with the status of the gRPC code
(``common.request.openai_json``); unknown paths and methods too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from common.basics.errors import RouteError
from common.config.access import Limits
from common.config.node import Endpoint
from common.config.openai_edge import OpenAIEdgeConfig
from common.request.call import CURRENT_CALL, CallInterceptor
from common.request.openai_call import CallAborted, HttpCallContext, call_metadata
from common.request.openai_json import (
    Answer,
    OpenAIError,
    Usage,
    grpc_error,
    model_entry,
    model_list,
)
from common.request.openai_sse import SseStream, error_response
from common.request.openai_v2 import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    BadField,
    OpenAIRequest,
    parse_openai,
    to_infer_request,
)
from common.request.proxy import InferenceProxy
from common.request.routing import ROUTE
from common.request.tokens import TokenCount
from common.request.v2 import response_text

log = logging.getLogger(__name__)

UNARY_METHOD = "ModelInfer"
# In-flight requests get this long to finish when the edge stops, as gRPC's grace.
STOP_GRACE_S = 5.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (unknown path, wrong method) in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        code = exc.reason.lower().replace(" ", "_")
        return error_response(OpenAIError(exc.status, message, code))


class OpenAIEdge:
    """The edge's OpenAI HTTP server; owns its aiohttp runner (``start`` / ``stop``).

    ``proxy`` is the tier's request path and ``calls`` its call interceptor (the
    observers: tracing, metrics, usage); ``clock`` stamps ``created``.
    """

    def __init__(
        self,
        config: OpenAIEdgeConfig,
        proxy: InferenceProxy,
        calls: CallInterceptor,
        *,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.proxy = proxy
        self.calls = calls
        self.limits = limits or proxy.limits
        self.max_body_bytes = self.limits.max_message_bytes // 2
        self.clock = clock
        self.port = config.endpoint.port
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return Endpoint(self.config.endpoint.host, self.port).address

    def app(self) -> web.Application:
        # The body limit is checked by the handler (413 in OpenAI's shape), not aiohttp.
        app = web.Application(middlewares=[openai_errors], client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        return app

    async def start(self) -> None:
        # Bound here (not by aiohttp) so port 0 tells which port it got; a taken port fails.
        endpoint = self.config.endpoint
        family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        sock = socket.create_server(
            (endpoint.host, endpoint.port), family=family, reuse_port=endpoint.reuse_port
        )
        self.port = sock.getsockname()[1]
        # handler_cancellation: a client that goes away cancels its request downstream.
        runner = web.AppRunner(
            self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=STOP_GRACE_S
        )
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            sock.close()
            raise
        self._runner = runner
        where = f"http://{self.address}/v1"
        log.info("openai edge listening %s", where, extra={"event": "openai_started", "url": where})

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish for ``STOP_GRACE_S``, cancel the rest."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ routes

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        return await self._serve(http, ROUTE_COMPLETIONS)

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        return await self._serve(http, ROUTE_CHAT)

    async def _models(self, http: web.Request) -> web.Response:
        refused = self._identify(self._context(http))
        return refused or web.json_response(model_list(self.proxy.models))

    async def _model(self, http: web.Request) -> web.Response:
        refused = self._identify(self._context(http))
        if refused is not None:
            return refused
        model = http.match_info["model"]
        if model not in self.proxy.models:
            known = ", ".join(sorted(self.proxy.models))
            return error_response(
                OpenAIError(404, f"model {model!r} is not served; known: {known}", "not_found")
            )
        return web.json_response(model_entry(model))

    # ------------------------------------------------------------------ requests

    def _context(self, http: web.Request) -> HttpCallContext:
        return HttpCallContext(call_metadata(http.headers), self.config.timeout_s)

    def _identify(self, ctx: HttpCallContext) -> web.Response | None:
        """The caller's key and routing headers, checked as the proxy checks them."""
        try:
            self.proxy.hints(ctx)
        except RouteError as err:
            return error_response(grpc_error(err.code, err.message, err.trailers))
        return None

    async def _serve(self, http: web.Request, route: str) -> web.StreamResponse:
        ctx = self._context(http)
        try:
            self.proxy.hints(ctx)  # the key first: OpenAI answers a bad key before a bad body
            if http.content_length is not None and http.content_length > self.max_body_bytes:
                return self._too_large()
            try:
                raw = await http.read()
            except web.HTTPRequestEntityTooLarge:
                return self._too_large()
            request = parse_openai(route, _json(raw))
        except RouteError as err:
            return await self._refused(ctx, err)
        prefix = "chatcmpl" if route == ROUTE_CHAT else "cmpl"
        answer = Answer(request, f"{prefix}-{uuid.uuid4().hex}", int(self.clock()))
        if request.stream:
            sse = SseStream(http, answer)
            ctx.stream_to(sse.write)
            return await sse.serve(self.proxy.stream_one, self.calls, ctx)
        return await self._unary(ctx, answer)

    def _too_large(self) -> web.Response:
        message = (
            f"the request body is over {self.max_body_bytes} bytes (half of "
            "limits.max_message_bytes); send a smaller one"
        )
        return error_response(OpenAIError(413, message, "request_too_large"))

    async def _refused(self, ctx: HttpCallContext, err: RouteError) -> web.Response:
        """Answer a request refused before the proxy ran, as an observed (counted) call."""

        async def refuse() -> None:
            # A caller known by its key leaves one usage record, as a V2 call refused
            # for its request does (``InferenceProxy`` reads the hints before parsing).
            call = CURRENT_CALL.get()
            if call is not None and call.hints is None:
                with contextlib.suppress(RouteError):  # the key itself was refused
                    call.hints = self.proxy.hints(ctx, call)
            await ctx.abort(err.code, err.message, err.trailers)

        with contextlib.suppress(CallAborted):
            await self.calls.observe(UNARY_METHOD, ctx.invocation_metadata(), ctx, refuse())
        param = err.param if isinstance(err, BadField) else None
        return error_response(grpc_error(err.code, err.message, err.trailers, param))

    async def _unary(self, ctx: HttpCallContext, answer: Answer) -> web.Response:
        infer = to_infer_request(answer.request, answer.id)
        try:
            handling = ctx.bounded(self.proxy.ModelInfer(infer, ctx))
            response = await self.calls.observe(
                UNARY_METHOD, ctx.invocation_metadata(), ctx, handling
            )
        except CallAborted as err:
            return error_response(grpc_error(err.code, err.details, err.trailers))
        count = TokenCount()
        count.add(response)
        body = answer.whole(response_text(response), _usage(answer.request, count))
        route = [v for k, v in ctx.trailers if k == ROUTE]
        return web.json_response(body, headers={ROUTE: route[0]} if route else None)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadField(None, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # ``[[[[…`` deeper than the parser's stack: a 500 otherwise
        raise BadField(None, "the request body is not valid JSON: nested too deeply") from None


def _usage(request: OpenAIRequest, count: TokenCount) -> Usage:
    """The GPU's counts, else the estimates the proxy bills: prompt words, max_tokens."""
    prompt = count.prompt if count.prompt is not None else len(request.prompt.split())
    completion = count.completion if count.completion is not None else request.max_tokens
    return Usage(prompt, completion)
