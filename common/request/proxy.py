"""The V2 service every tier serves: receive, validate, pick, forward, stream back.

Every tier is this proxy with its own balancer (a picker plus whatever the tier
reserves per attempt). The ``InferenceProxy`` validates the generate request
and routing metadata (INVALID_ARGUMENT), refuses unknown models (NOT_FOUND),
asks its ``Gate`` who the caller is and whether its limits admit the request,
and hands the call to the forwarding loop (``common.request.forwarding``: retry,
back-off, budget, failover, ``x-meridian-route``). What the call did goes into
its ``CallRecord`` (``common.request.call``), from which interceptors trace,
count and bill it; the proxy itself makes no span, metric or usage record.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from common.basics.errors import RouteError
from common.basics.geo import GeoPoint
from common.basics.vocabulary import ANONYMOUS_TENANT, Priority
from common.capacity.summary import CAPACITY_HINT
from common.config.access import Limits
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.abort import abort_call
from common.request.attempt import UnaryAttempt
from common.request.balancer import Balancer
from common.request.call import STREAM_METHOD, CallRecord, call_of
from common.request.children import ChildSet
from common.request.forwarding import Forwarder
from common.request.pick import PickRequest
from common.request.prefix import MAX_CARRIED_BLOCKS, prompt_block_hashes
from common.request.routing import RouteHints, parse_hints
from common.request.stream_limits import OpenStreams
from common.request.stream_request import RequestPath, StreamRequestAttempt
from common.request.streaming import Release, StreamRelay, no_release
from common.request.v2 import MAX_NAME_CHARS, GenerateRequest, parse_generate

VERSION = "0.1.0"


async def _one(request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferRequest]:
    yield request


@dataclass(frozen=True)
class TierSpec:
    """What makes a proxy one particular tier."""

    tier: str
    # Inner tiers believe internal metadata from the tier above; the edge does not.
    trust_internal: bool
    resolve_origin: Callable[[RouteHints], GeoPoint | None]
    # Its children are the GPU servers, where a stream's tokens enter the chain: the
    # tier that holds them for ``limits.stream_coalesce_ms`` (once: a window at every
    # tier would add up) so that every tier above relays fewer, larger messages.
    gpu_children: bool = False


class Gate(Protocol):
    """Who is calling and whether its limits let the request in
    (``common.tenancy.admission.Admission``)."""

    def identify(self, metadata: object, hints: RouteHints) -> RouteHints: ...

    async def admit(
        self, hints: RouteHints, pick: PickRequest, call: CallRecord | None = None
    ) -> Release:
        """Admit the request or raise RouteError; what a token quota charged goes into
        ``call.tokens_charged``, to be settled on the real count when the call ends."""
        ...


class OpenGate:
    """Everyone is the anonymous tenant and every request is admitted."""

    def identify(self, metadata: object, hints: RouteHints) -> RouteHints:
        return hints

    async def admit(
        self, hints: RouteHints, pick: PickRequest, call: CallRecord | None = None
    ) -> Release:
        return no_release


class InferenceProxy(pb_grpc.GRPCInferenceServiceServicer):
    """A V2 server that forwards every call to a child its balancer chooses."""

    def __init__(
        self,
        spec: TierSpec,
        children: ChildSet,
        balancer: Balancer,
        forwarder: Forwarder,
        *,
        gate: Gate | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.spec = spec
        self.children = children
        self.balancer = balancer
        self.forwarder = forwarder
        self.gate: Gate = gate or OpenGate()
        self.limits = limits or Limits()
        self.models = frozenset(m for c in children for m in c.models)
        self.coalesce_s = self.limits.stream_coalesce_ms / 1000 if spec.gpu_children else 0.0
        # Open streams per tenant, capped at the edge only: inner tiers see one stream
        # per request in flight, which the tenant's concurrency cap already bounds.
        self.open_streams = (
            None if spec.trust_internal else OpenStreams(self.limits.max_open_streams_per_tenant)
        )

    def serve_models(self, models: frozenset[str]) -> None:
        """The models this tier answers for from now on (a reload or a child leaving)."""
        self.models = models

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
        pick = PickRequest(request.name, request.version, None, None, Priority.STANDARD)
        return pb.ModelReadyResponse(
            ready=request.name in self.models and bool(self.balancer.ranked(pick))
        )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        try:
            hints = self.hints(context)
            pick = self.pick_request(request.name, request.version, hints, None)
            attempt: UnaryAttempt[pb.ModelMetadataResponse] = UnaryAttempt("ModelMetadata", request)
            deadline = self.forwarder.deadline_in(context.time_remaining())
            response, _, trailers = await self.forwarder.forward(attempt, pick, hints, deadline)
            context.set_trailing_metadata(trailers)
            return response
        except RouteError as err:
            await self.abort(context, err, request.name)
            raise  # unreachable: abort raises

    # ------------------------------------------------------------------ inference

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        call = call_of("ModelInfer", context)
        call.model = request.model_name
        try:
            hints = call.hints = self.hints(context, call)
            gen = parse_generate(request, self.limits)
            pick = self.pick_request(gen.model, gen.version, hints, gen)
            call.prompt_tokens, call.max_tokens = pick.prompt_tokens, pick.max_tokens
            release = await self.gate.admit(hints, pick, call)
            try:
                attempt: UnaryAttempt[pb.ModelInferResponse] = UnaryAttempt("ModelInfer", request)
                deadline = self.forwarder.deadline_in(context.time_remaining())
                response, call.route, trailers = await self.forwarder.forward(
                    attempt, pick, hints, deadline, call.span
                )
                context.set_trailing_metadata(trailers)
            finally:
                release()
            # The GPU's own counts, passed up by every tier (read once, by the attempt);
            # else the estimate stands.
            attempt.count.fill(call, completion_estimate=pick.max_tokens)
            return response
        except RouteError as err:
            await self.abort(context, err, request.model_name)
            raise

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Every request of the stream on its own (``common.request.streaming``)."""
        call = call_of("ModelStreamInfer", context)
        try:
            hints = call.hints = self.hints(context, call)
            release = (
                no_release
                if self.open_streams is None
                else self.open_streams.open(hints.tenant or ANONYMOUS_TENANT)
            )
            try:
                relay = StreamRelay(
                    context,
                    call,
                    self._request_path(hints, context, call),
                    self.limits,
                    single=hints.single_request,
                    coalesce_s=self.coalesce_s,
                )
                await relay.relay(request_iterator)
            finally:
                release()
        except RouteError as err:
            await self.abort(context, err, call.model)

    async def stream_one(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """One streamed request from another front end on this proxy (the OpenAI edge's
        SSE): a ModelStreamInfer of that one request whose failure ends the call with
        its status (and trailers), as ``x-meridian-single-request`` makes it between
        tiers, so a refusal before any response is an HTTP status, not a stream event."""
        call = call_of(STREAM_METHOD, context)
        try:
            hints = call.hints = self.hints(context, call)
            path = self._request_path(hints, context, call)
            relay = StreamRelay(
                context, call, path, self.limits, single=True, coalesce_s=self.coalesce_s
            )
            await relay.relay(_one(request))
        except RouteError as err:
            await self.abort(context, err, call.model)

    def _request_path(
        self, hints: RouteHints, context: grpc.aio.ServicerContext, call: CallRecord
    ) -> RequestPath:
        """What this tier does for each request of a stream: what ModelInfer does."""

        async def admit(pick: PickRequest, record: CallRecord) -> Release:
            return await self.gate.admit(hints, pick, record)

        async def forward(attempt: StreamRequestAttempt, pick: PickRequest) -> str:
            # Each request's own trailers: the stream ends with its last request's.
            deadline = self.forwarder.deadline_in(context.time_remaining())
            _, route, trailers = await self.forwarder.forward(
                attempt, pick, hints, deadline, call.span
            )
            context.set_trailing_metadata(trailers)
            return route

        return RequestPath(
            parse=lambda request: parse_generate(request, self.limits),
            pick=lambda gen: self.pick_request(gen.model, gen.version, hints, gen),
            admit=admit,
            forward=forward,
            hop=lambda child: self.forwarder.route_of(child, ()),
        )

    # ------------------------------------------------------------------ shared mechanics

    async def abort(self, context: grpc.aio.ServicerContext, err: RouteError, model: str) -> None:
        """End the call with ``err``, telling the tier above what capacity is left here."""
        hint = self.forwarder.hint(model)
        trailers = (*err.trailers, (CAPACITY_HINT, hint)) if hint else err.trailers
        await abort_call(context, err.code, err.message, trailers)  # quiet past the deadline

    def hints(
        self, context: grpc.aio.ServicerContext, call: CallRecord | None = None
    ) -> RouteHints:
        # The call's record holds the metadata already (each invocation_metadata() call
        # builds it anew).
        metadata = context.invocation_metadata() if call is None else tuple(call.metadata)
        hints = parse_hints(metadata, trust_internal=self.spec.trust_internal)
        return self.gate.identify(metadata, hints)

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
        max_tokens = gen.max_tokens if gen else 0
        return PickRequest(
            model=model,
            version=version,
            origin=self.spec.resolve_origin(hints),
            session=hints.session,
            priority=hints.priority,
            prompt_tokens=gen.prompt_tokens if gen else 0,
            max_tokens=max_tokens,
            tenant=hints.tenant,
            client_region=hints.client_region,
            allowed_regions=hints.allowed_regions,
            prefix_blocks=blocks,
            planned_output=self.forwarder.outputs.planned(model, max_tokens),
        )
