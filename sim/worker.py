"""The emulated GPU inference server: a KServe V2 gRPC endpoint around one ``GpuEngine``,
or, for a GPU whose entry says ``protocol: openai``, vLLM's OpenAI HTTP API around it
(``sim.openai_server``; the rest of this docstring is about the V2 side).

Each worker also serves Prometheus text on ``/metrics`` with vLLM's metric
names, so the local tier scrapes it exactly as it would scrape a real vLLM.
Every unary response (and every stream, at its end) carries trailing metadata
``x-meridian-route`` (the GPU name) and ``x-meridian-load``
(``running=<n>,waiting=<n>,kv=<0..1>``), a free load sample for the router.
Every response says what the request really cost so far (``sim.answers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, TypeAlias

import grpc
from aiohttp import web

from common.basics.errors import RouteError
from common.config.gpu import DEFAULT_VERSIONS, GpuConfig
from common.config.node import Endpoint
from common.config.topology import ZoneConfig
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2Server
from common.request.v2 import GenerateRequest, parse_generate, wants_stream
from sim.answers import answer, answer_length, stream_error, stream_response
from sim.engine import EngineError, GpuEngine, RequestTooLarge
from sim.openai_server import OpenAIServer
from sim.stream_out import merged_while_waiting
from sim.vllm_metrics import PROMETHEUS_CONTENT_TYPE, metrics_text

log = logging.getLogger(__name__)

SERVER_NAME = "meridian-sim-gpu"
SERVER_VERSION = "0.1.0"
PLATFORM = "meridian-sim"
ROUTE_HEADER = "x-meridian-route"
LOAD_HEADER = "x-meridian-load"
# Responses one stream may hold waiting to be written: beyond that its requests stop
# taking tokens from the engine, so a caller that stops reading holds generation
# back instead of growing memory (the engine keeps at most a request's max_tokens).
STREAM_QUEUE_RESPONSES = 64
ServerTls: TypeAlias = grpc.ServerCredentials | None  # None: plaintext


def _engine_error(exc: EngineError) -> RouteError:
    if isinstance(exc, RequestTooLarge):
        # No retry on this GPU can help; the caller must change the request.
        return RouteError.invalid(str(exc))
    return RouteError.unavailable(str(exc))


class GpuWorker(pb_grpc.GRPCInferenceServiceServicer):
    """One emulated GPU: V2 gRPC on ``gpu.endpoint``, Prometheus on ``gpu.metrics_endpoint``
    (protocol ``openai``: vLLM's HTTP API on ``gpu.endpoint``, ``/metrics`` included).

    Its exit stack tears it down in reverse order: gRPC stops accepting and drains for
    ``grace``, then metrics, then the engine. Serves TLS with ``tls`` if its entry says so.
    """

    def __init__(
        self, gpu: GpuConfig, *, region: str, zone: str, time_scale: float, tls: ServerTls = None
    ) -> None:
        self.gpu, self.tls = gpu, (tls if gpu.tls is not None else None)
        self.region = region
        self.zone = zone
        self.engine = GpuEngine(gpu, time_scale=time_scale)
        # Created in start(): the gRPC server binds to the running event loop.
        self._server: V2Server | None = None
        self._api: OpenAIServer | None = None  # protocol "openai"
        self._metrics_runner: web.AppRunner | None = None
        self.port = gpu.endpoint.port
        self.metrics_port = gpu.metrics_endpoint.port
        self._ready = False
        self._grace = 0.0
        self._stack: contextlib.AsyncExitStack | None = None
        # Each open stream's queue of responses waiting to be written.
        self._stream_queues: set[asyncio.Queue[pb.ModelStreamInferResponse | None]] = set()

    @property
    def stream_backlog(self) -> int:
        """Responses waiting in this GPU's open streams to be written to their callers."""
        return sum(queue.qsize() for queue in self._stream_queues)

    @property
    def address(self) -> str:
        return Endpoint(self.gpu.endpoint.host, self.port).address

    @property
    def metrics_address(self) -> str:
        return Endpoint(self.gpu.metrics_endpoint.host, self.metrics_port).address

    async def start(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            await self.engine.start()
            stack.push_async_callback(self.engine.stop)
            openai = self.gpu.protocol == "openai"
            if not openai or self.gpu.metrics_endpoint != self.gpu.endpoint:
                await self._start_metrics()
                stack.push_async_callback(self._stop_metrics)
            if openai:
                api = self._api = OpenAIServer(self.gpu, self.engine, lambda: self._ready)
                await api.start()
                stack.push_async_callback(lambda: api.stop(self._grace))
                self.port = api.port
                self.metrics_port = self.metrics_port or api.port
            else:
                server = self._server = V2Server(self, self.gpu.endpoint, credentials=self.tls)
                await server.start()
                stack.push_async_callback(self._stop_server)
                self.port = server.port
                await server.set_serving(True)
            self._ready = True
            self._stack = stack.pop_all()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, let in-flight calls finish for ``grace`` s, then cancel them."""
        self._ready = False
        self._grace = grace
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def _stop_server(self) -> None:
        if self._server is not None:
            await self._server.stop(self._grace)
            self._server = None

    async def _start_metrics(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            where = self.gpu.metrics_endpoint
            site = web.TCPSite(runner, where.host, where.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._metrics_runner = runner
        self.metrics_port = int(runner.addresses[0][1])

    async def _stop_metrics(self) -> None:
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    # ------------------------------------------------------------------ metrics

    def metrics_text(self) -> str:
        """The Prometheus exposition of this GPU's engine, one series per model."""
        return metrics_text(self.gpu, self.engine)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics_text().encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE}
        )

    def _trailers(self) -> tuple[tuple[str, str], ...]:
        e = self.engine
        load = f"running={e.running},waiting={e.waiting},kv={e.kv_cache_usage:.3f}"
        return ((ROUTE_HEADER, self.gpu.name), (LOAD_HEADER, load))

    # ------------------------------------------------------------------ V2 service

    # Health probes get the load trailers too: a free load sample for the local tier.

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> Any:
        context.set_trailing_metadata(self._trailers())
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> Any:
        context.set_trailing_metadata(self._trailers())
        return pb.ServerReadyResponse(ready=self._ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> Any:
        context.set_trailing_metadata(self._trailers())
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=[])

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> Any:
        context.set_trailing_metadata(self._trailers())
        known = self.gpu.serves(request.name, request.version)
        return pb.ModelReadyResponse(ready=self._ready and known)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> Any:
        try:
            self._check_model(request.name, request.version)
        except RouteError as exc:
            await self._abort(context, exc)
        context.set_trailing_metadata(self._trailers())
        meta = pb.ModelMetadataResponse
        return meta(
            name=request.name,
            versions=sorted(self.gpu.versions.get(request.name, DEFAULT_VERSIONS)),
            platform=PLATFORM,
            inputs=[
                meta.TensorMetadata(name="text_input", datatype="BYTES", shape=[1]),
                meta.TensorMetadata(name="max_tokens", datatype="INT32", shape=[1]),
            ],
            outputs=[meta.TensorMetadata(name="text_output", datatype="BYTES", shape=[-1])],
        )

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        try:
            gen = self._parse(request)
            async with contextlib.aclosing(self._generate(gen, answer_length(request, gen))) as it:
                words = [token async for token in it]
        except RouteError as exc:
            await self._abort(context, exc)
        context.set_trailing_metadata(self._trailers())
        return answer(request, gen, " ".join(words), len(words), report=self.gpu.report_tokens)

    async def _abort(self, context: Any, exc: RouteError) -> None:
        """End the call with ``exc``'s status; raises (grpc's abort never returns)."""
        await context.abort(
            exc.code, exc.message, trailing_metadata=self._trailers() + exc.trailers
        )

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Serve each request of the stream in its own task; responses share one queue.

        A request with the ``stream`` parameter gets one response per token, the
        last marked final (tokens that waited together for the writer go as one,
        ``sim.stream_out``, as vLLM's); without it, one final response with the whole text
        (Triton's generate convention). A bad request yields a response with
        ``error_message`` and the stream goes on (Triton's behaviour). The stream
        ends when the client half-closes and every request is answered. The queue
        is bounded (``STREAM_QUEUE_RESPONSES``): a caller that stops reading blocks
        the requests' ``put``, and they stop consuming the engine's tokens.
        """
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(
            STREAM_QUEUE_RESPONSES
        )
        tasks: set[asyncio.Task[None]] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(self._stream_one(request, out))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.wait(set(tasks))
            finally:
                # The end (or reading failed): the writer stops after what it has queued.
                # Cancelled, the stream is being torn down and nobody reads any more.
                me = asyncio.current_task()
                if me is None or not me.cancelling():
                    await out.put(None)

        reader = asyncio.create_task(read())
        self._stream_queues.add(out)
        try:
            async for response in merged_while_waiting(out):
                yield response
            context.set_trailing_metadata(self._trailers())
        finally:
            self._stream_queues.discard(out)
            for task in (reader, *tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _stream_one(
        self, request: pb.ModelInferRequest, out: asyncio.Queue[pb.ModelStreamInferResponse | None]
    ) -> None:
        report = self.gpu.report_tokens
        try:
            gen = self._parse(request)
            length = answer_length(request, gen)
            if not wants_stream(request):
                # `stream: false` asks for the whole text in one final response.
                async with contextlib.aclosing(self._generate(gen, length)) as tokens:
                    words = [token async for token in tokens]
                whole = answer(request, gen, " ".join(words), len(words), report=report, final=True)
                await out.put(stream_response(whole))
                return
            async with contextlib.aclosing(self._generate(gen, length)) as tokens:
                i = 0
                async for token in tokens:
                    i += 1
                    response = answer(request, gen, token, i, report=report, final=i == length)
                    await out.put(stream_response(response))
        except RouteError as exc:
            await out.put(stream_error(request, f"{exc.code.name}: {exc.message}"))
        except Exception as exc:  # a bug must still answer the request, not drop it
            await out.put(stream_error(request, f"INTERNAL: {type(exc).__name__}: {exc}"))

    def _parse(self, request: pb.ModelInferRequest) -> GenerateRequest:
        gen = parse_generate(request)
        self._check_model(gen.model, gen.version)
        return gen

    async def _generate(self, gen: GenerateRequest, length: int) -> AsyncGenerator[str, None]:
        """The answer's ``length`` engine tokens, engine failures turned into ``RouteError``."""
        try:
            async with contextlib.aclosing(
                self.engine.generate(
                    gen.prompt, gen.max_tokens, model=gen.model, answer_tokens=length
                )
            ) as tokens:
                async for token in tokens:
                    yield token
        except EngineError as exc:
            raise _engine_error(exc) from None

    def _check_model(self, name: str, version: str) -> None:
        if name not in self.gpu.models:
            raise RouteError.not_found(
                f"model {name!r} is not served by GPU {self.gpu.name}; "
                f"it serves {list(self.gpu.models)}"
            )
        if not self.gpu.serves(name, version):
            known = sorted(self.gpu.versions.get(name, DEFAULT_VERSIONS))
            raise RouteError.not_found(
                f"model {name!r} has no version {version!r} on GPU {self.gpu.name}; "
                f"versions: {known}"
            )


class ZoneWorkers:
    """Every GPU of one zone, each its own ``GpuWorker`` (sharing ``tls``), in one process."""

    def __init__(
        self, zone: ZoneConfig, *, region: str, time_scale: float, tls: ServerTls = None
    ) -> None:
        self.zone = zone
        self.workers = [
            GpuWorker(gpu, region=region, zone=zone.name, time_scale=time_scale, tls=tls)
            for gpu in zone.gpus
        ]
        self._started: list[GpuWorker] = []

    async def start(self) -> None:
        try:
            for worker in self.workers:
                await worker.start()
                self._started.append(worker)
        except BaseException:
            await self.stop(0)
            raise

    async def stop(self, grace: float = 1.0) -> None:
        started, self._started = self._started, []
        await asyncio.gather(*(w.stop(grace) for w in reversed(started)))

    def __iter__(self) -> Iterator[GpuWorker]:
        return iter(self.workers)


async def run_zone_workers(
    zone: ZoneConfig, region: str, time_scale: float, stop: asyncio.Event, tls: ServerTls = None
) -> None:
    """Serve a zone's GPUs until ``stop`` is set; log one line per GPU once listening
    (through the process's log handler, so JSON logs stay JSON)."""
    workers = ZoneWorkers(zone, region=region, time_scale=time_scale, tls=tls)
    await workers.start()
    try:
        for w in workers:
            name, address, metrics = w.gpu.name, w.address, w.metrics_address
            fields = {"event": "worker_started", "gpu": name, "address": address}
            log.info("worker %s listening %s metrics %s", name, address, metrics, extra=fields)
        await stop.wait()
    finally:
        await workers.stop()
