"""The local tier as Envoy's endpoint picker: ext_proc in, a GPU's address out.

In this mode Envoy carries the bytes and the zone's local tier only decides.
Envoy's ext_proc filter opens one ``Process`` stream per HTTP request and sends
(with the processing mode of ``deploy/envoy``) the request headers, the whole
request body, the response headers and the response trailers. ``Exchange``
follows one such stream:

1. request headers: route and ``x-meridian-*`` hints (``local_lb.ext_proc_request``);
   continue, the body follows;
2. request body: read the model, acquire a lease from the zone's
   ``LocalBalancer`` — the same balancer, slots, central queue, affinity and
   ejection as the proxy mode, so both modes share one account of every GPU —
   and answer with the chosen GPU and its fallbacks (``local_lb.ext_proc_reply``);
   a refusal becomes Envoy's immediate response (503, 429, 400, 404, 504);
3. response headers: learn the endpoint that served; when Envoy fell back to
   another GPU, the chosen one is released as failed (the data plane could not
   use it) and the request is counted on the one that served;
4. the end: response trailers (a gRPC call's status and the GPU's
   ``x-meridian-load`` report), response headers that end the response, or the
   close of the ext_proc stream: release the lease with the call's status.

An HTTP response without trailers (an OpenAI GPU's SSE stream or JSON answer over
HTTP/1.1, whose body never goes through the picker) ends only with the stream:
Envoy closes it when the HTTP request ends, so the lease is released with the
status its response headers gave (200: OK) and the time to that close, which is
the request's service time the balancer learns. Envoy closes it the same way when
the caller goes away or the GPU resets mid-response, which the picker cannot tell
from a whole answer without a body or trailer phase: such a request also counts
as served, its time short (a GPU that died is still caught by its health checks
and by Envoy's next connect failure). Only a lease whose response never gave a
status (a gRPC call without its trailers, a caller gone before the response
headers) is released as CANCELLED, which teaches the balancer nothing. Whatever
happens, the lease is released exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.basics.errors import RouteError
from common.config.access import Limits
from common.config.ext_proc import ExtProcConfig
from common.config.node import Endpoint
from common.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from common.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from common.request.balancer import Lease, Outcome
from common.request.children import ChildSet
from common.request.pick import PickRequest
from common.request.prefix import MAX_CARRIED_BLOCKS, prompt_block_hashes
from common.request.server import server_options
from common.request.v2 import GenerateRequest
from local_lb.balancer import LocalBalancer
from local_lb.ext_proc_reply import destination, go_on, refusal, served_endpoint, status_of
from local_lb.ext_proc_reply import subset_hint as read_subset_hint
from local_lb.ext_proc_request import RequestHead, header_pairs, is_grpc, read_body, read_head
from local_lb.state import GpuChild

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
# Health service names of the endpoint-picker protocol, beside the whole server's "".
HEALTH_NAMES = ("", EXT_PROC_SERVICE, "liveness", "readiness")


class Exchange:
    """One ext_proc stream: one HTTP request's pick and its lease."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.head: RequestHead | None = None
        self.subset: frozenset[str] | None = None
        self.body = b""
        self.pick: PickRequest | None = None
        self.lease: Lease | None = None
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.grpc_call = False

    async def handle(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        kind = request.WhichOneof("request") or ""
        if self.subset is None:
            self.subset = read_subset_hint(request)
        try:
            if kind == "request_headers":
                return await self._request_headers(request.request_headers)
            if kind == "request_body":
                return await self._request_body(request.request_body)
            if kind == "response_headers":
                return self._response(request, request.response_headers, kind)
            if kind == "response_trailers":
                return self._response(request, request.response_trailers, kind)
        except RouteError as err:
            return refusal(err, grpc_call=self.grpc_call)
        return go_on(kind)  # request trailers, response body: nothing to decide

    async def _request_headers(self, message: ep.HttpHeaders) -> ep.ProcessingResponse:
        headers = header_pairs(message.headers.headers)
        self.grpc_call = is_grpc(headers)
        self.head = read_head(headers)
        if message.end_of_stream:
            raise RouteError.invalid(
                f"{self.head.path} needs a request body naming the model; this request has none"
            )
        return go_on("request_headers")

    async def _request_body(self, message: ep.HttpBody) -> ep.ProcessingResponse:
        if self.head is None:
            raise RouteError(grpc.StatusCode.INTERNAL, "request body before its headers")
        if not message.end_of_stream:
            raise RouteError(
                grpc.StatusCode.INTERNAL,
                "the endpoint picker needs the whole request body at once; configure "
                "Envoy's ext_proc filter with request_body_mode: BUFFERED",
            )
        gen = read_body(self.head, self.body + message.body, self.picker.limits)
        self.body = b""
        endpoints = await self._choose(gen)
        return destination(endpoints, body_phase=True)

    async def _choose(self, gen: GenerateRequest) -> list[str]:
        head = self.head
        assert head is not None
        pick = self.pick = self.picker.pick_request(gen, head)
        timeout = self.picker.config.max_wait_s
        if head.timeout_s is not None:
            timeout = min(timeout, head.timeout_s)
        excluded = self.picker.outside(self.subset, pick)
        lease = await self.picker.balancer.acquire(pick, excluded, timeout)
        if lease.child.name in excluded:  # bound from the queue to a GPU outside the hint
            self.picker.balancer.release(lease, _cancelled(lease, self.picker))
            raise RouteError.exhausted(
                f"every GPU of the subset hint serving {pick.model!r} is full", 1000
            )
        self.lease = lease
        return self.picker.endpoints(lease, pick, excluded)

    def _response(
        self, request: ep.ProcessingRequest, message: Any, kind: str
    ) -> ep.ProcessingResponse:
        is_headers = kind == "response_headers"
        headers = header_pairs((message.headers if is_headers else message.trailers).headers)
        served = served_endpoint(request, headers)
        if served is not None:
            self._served(served)
        status = status_of(headers, grpc_call=self.grpc_call)
        if status is not None:
            self.status = status
        if not is_headers or message.end_of_stream:
            self.finish(headers)
        return go_on(kind)

    def _served(self, endpoint: str) -> None:
        """Envoy served (or last tried) ``endpoint``: move the lease there if it was
        not the GPU chosen."""
        gpu = self.picker.gpu_at(endpoint)
        lease, pick = self.lease, self.pick
        if gpu is None or lease is None or pick is None or gpu is lease.child:
            return
        balancer = self.picker.balancer
        fell_back = f"Envoy fell back from it to {endpoint}"
        balancer.release(lease, self._outcome(grpc.StatusCode.UNAVAILABLE, fell_back, ()))
        self.lease = balancer.lease_on(gpu, pick)

    def finish(self, trailers: Any = ()) -> None:
        """Release the lease (once) with what is known of how the call ended."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        # Without a status (see the module docstring): the call ended before its response.
        code, detail = self.status or (grpc.StatusCode.CANCELLED, "the ext_proc stream closed")
        self.picker.balancer.release(lease, self._outcome(code, detail, trailers, lease))

    def _outcome(
        self, code: grpc.StatusCode, detail: str, trailers: Any, lease: Lease | None = None
    ) -> Outcome:
        lease = lease or self.lease
        started = lease.started_at if lease is not None else self.picker.balancer.clock()
        elapsed = self.picker.balancer.clock() - started
        return Outcome(code, elapsed, trailers=tuple(trailers), detail=detail)


def _cancelled(lease: Lease, picker: EndpointPicker) -> Outcome:
    elapsed = picker.balancer.clock() - lease.started_at
    return Outcome(grpc.StatusCode.CANCELLED, elapsed, detail="not used")


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over a zone's ``LocalBalancer``."""

    def __init__(self, balancer: LocalBalancer, config: ExtProcConfig, limits: Limits) -> None:
        self.balancer = balancer
        self.config = config
        self.limits = limits
        self._gpus: tuple[GpuChild, ...] = ()
        self._by_endpoint: dict[str, GpuChild] = {}

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        exchange = Exchange(self)
        try:
            async for request in request_iterator:
                reply = await exchange.handle(request)
                yield reply
                if reply.WhichOneof("response") == "immediate_response":
                    return
        finally:  # Envoy closed the stream, or the caller went away: no slot leaks
            exchange.finish()

    def gpu_at(self, endpoint: str) -> GpuChild | None:
        gpus = self.balancer.view.gpus
        if gpus is not self._gpus:  # the GPU set changed (a reload): index it again
            self._gpus = gpus
            self._by_endpoint = {g.endpoint.address: g for g in gpus}
        return self._by_endpoint.get(endpoint)

    def pick_request(self, gen: GenerateRequest, head: RequestHead) -> PickRequest:
        hints = head.hints
        blocks = prompt_block_hashes(gen.prompt, model=gen.model, limit=MAX_CARRIED_BLOCKS)
        return PickRequest(
            model=gen.model,
            version=gen.version,
            origin=None,
            session=hints.session,
            priority=hints.priority,
            prompt_tokens=gen.prompt_tokens,
            max_tokens=gen.max_tokens,
            prefix_blocks=tuple(blocks),
        )

    def outside(self, subset: frozenset[str] | None, pick: PickRequest) -> frozenset[str]:
        """Names of the GPUs the subset hint leaves out (none without a hint); 503 when
        it leaves no usable GPU serving the model."""
        if subset is None:
            return frozenset()
        serving = self.balancer.view.serving(pick.model, pick.version)
        allowed = [g for g in serving if g.endpoint.address in subset]
        if not any(g.usable for g in allowed):
            raise RouteError.unavailable(
                f"no usable GPU for {pick.model!r} among the {len(subset)} endpoints of the "
                f"subset hint ({', '.join(sorted(subset)[:8]) or 'empty'})"
            )
        names = {g.name for g in allowed}
        return frozenset(g.name for g in self.balancer.view.gpus if g.name not in names)

    def endpoints(self, lease: Lease, pick: PickRequest, excluded: frozenset[str]) -> list[str]:
        """The chosen GPU's address, then up to ``fallbacks`` more: the policy's
        ranking first, then any other usable GPU serving the model."""
        chosen = [lease.child.endpoint.address]
        want = self.config.fallbacks
        if not want:
            return chosen
        seen = {lease.child.name, *excluded}
        ranked = self.balancer.ranked(pick)
        others = self.balancer.view.serving(pick.model, pick.version)
        for gpu in (*ranked, *others):
            if len(chosen) > want:
                break
            if gpu.name not in seen and isinstance(gpu, GpuChild) and gpu.usable:
                seen.add(gpu.name)
                chosen.append(gpu.endpoint.address)
        return chosen


class ExtProcServer:
    """The picker's own gRPC server (ext_proc and grpc.health.v1) beside the tier's V2
    server; a ``Service`` of the local tier's ``TierServer``. Health answers SERVING
    while some GPU is healthy, under the protocol's names and the server's own."""

    def __init__(
        self,
        picker: EndpointPicker,
        endpoint: Endpoint,
        children: ChildSet,
    ) -> None:
        self.picker = picker
        self.endpoint = endpoint
        self.children = children
        self.port = endpoint.port
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return Endpoint(self.endpoint.host, self.port).address

    async def start(self) -> None:
        server = grpc.aio.server(
            options=server_options(self.picker.limits, reuse_port=self.endpoint.reuse_port)
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(self.endpoint.address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.endpoint.address}: address in use or invalid")
        await server.start()
        self._server = server
        await self._set_health()
        self.children.add_listener(self._health_changed)
        fields = {"event": "ext_proc_started", "address": self.address}
        log.info("endpoint picker (Envoy ext_proc) listening %s", self.address, extra=fields)

    def _health_changed(self) -> None:
        """A GPU's health changed (called in the loop): tell the health service."""
        if self._server is None:
            return
        task = asyncio.get_running_loop().create_task(self._set_health())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _set_health(self) -> None:
        # The status is read again before each write: several of these tasks can be
        # under way at once, and one that read the health before a later change must
        # not write its stale answer over the newer one's.
        for name in HEALTH_NAMES:
            serving = self._server is not None and self.children.any_healthy()
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await self.health.set(name, status)

    async def stop(self, grace: float = 0.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await self._set_health()
        await server.stop(grace)
        for task in list(self._pending):
            await task


def extproc_services(
    config: ExtProcConfig | None, balancer: LocalBalancer, children: ChildSet, limits: Limits
) -> list[ExtProcServer]:
    """The local tier's endpoint-picker server when ``config`` asks for one."""
    if config is None:
        return []
    return [ExtProcServer(EndpointPicker(balancer, config, limits), config.listen, children)]
