"""Forwarding to a GPU that speaks OpenAI HTTP, behind the V2 stub's two calls.

The forwarding loop (``common.request.forwarding``, ``stream_request``) sends an
attempt as ``child.stub.ModelInfer(request, metadata=, timeout=)`` or
``child.stub.ModelStreamInfer(requests, metadata=, timeout=)`` and reads the
answer, the trailers and failures as grpc.aio's call objects give them. An
``OpenAIStub`` is that interface for one OpenAI GPU: it turns the V2 request into
an OpenAI one (``local_lb.openai_wire``), sends it over the tier's pooled
keep-alive HTTP (``OpenAIPool``: one aiohttp session per local tier, its
connections sized to the GPUs' slots), and answers as a V2 server would: a
response, or stream responses one per SSE chunk, the token counts on the last;
every failure a ``grpc.aio.AioRpcError`` with the code of the same meaning (no
connection or a connection lost: UNAVAILABLE, so the loop fails over while
nothing went back; HTTP 429: RESOURCE_EXHAUSTED with ``retry-after-ms``; HTTP 500
or a malformed answer: INTERNAL; the caller's deadline: DEADLINE_EXCEEDED). So
retries, ejection, slow start, affinity, the central queue and tenancy do not
know which protocol a GPU speaks.

Cancelling an attempt (the caller left, a per-try timeout) closes its HTTP
connection, which is how an OpenAI server learns to stop generating.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Coroutine, Generator, Iterable
from typing import Any

import aiohttp
import grpc

from common.basics.errors import RETRY_AFTER_MS, RouteError
from common.config.gpu import GpuConfig
from common.gen.inference import grpc_service_pb2 as pb
from common.request.v2 import wants_stream
from local_lb.openai_wire import (
    BadAnswer,
    OpenAICall,
    Piece,
    answer_piece,
    chunk_piece,
    error_detail,
    grpc_code,
    openai_call,
    parse_json,
    retry_after_ms,
    stream_error,
    v2_response,
)

Metadata = list[tuple[str, str]]
# Headers of the tier's metadata passed on: the trace continues into the GPU server.
PASSED_HEADERS = ("traceparent", "tracestate")
# A TCP connect that takes longer is a GPU that is not there (the per-try timeout
# and the caller's deadline bound the rest).
CONNECT_TIMEOUT_S = 2.0
# Longest SSE line read (a chunk carries a token or a few).
MAX_LINE_BYTES = 1 << 20
_DONE = b"[DONE]"


class OpenAIPool:
    """The local tier's one HTTP client session to its OpenAI GPUs (a tier service).

    Keep-alive connections, at most ``per_gpu`` to one GPU (its slots: the balancer
    never has more requests in flight there) and ``total`` in all. Created in
    ``start()`` inside the running loop, closed in ``stop()``.
    """

    def __init__(self, per_gpu: int, total: int) -> None:
        self.per_gpu = max(1, per_gpu)
        self.total = max(self.per_gpu, total)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def for_zone(cls, gpus: Iterable[GpuConfig]) -> OpenAIPool:
        """Sized for a zone's GPUs: per GPU the most slots one has (so a GPU added by a
        reload fits too, unless it has more), in all their sum."""
        slots = [g.max_concurrency for g in gpus]
        return cls(per_gpu=max(slots, default=16), total=sum(slots))

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.total, limit_per_host=self.per_gpu)
        self._session = aiohttp.ClientSession(
            connector=connector, read_bufsize=1 << 16, max_line_size=MAX_LINE_BYTES
        )

    async def stop(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the tier's HTTP client is not running")
        return self._session


def stub_for(gpu: GpuConfig, pool: OpenAIPool | None) -> OpenAIStub | None:
    """The stub of a GPU whose entry says ``protocol: openai`` (None for a V2 GPU, whose
    gRPC stub its channel gives, and without a pool: the fleet simulator's, which sends
    nothing)."""
    if gpu.protocol != "openai" or pool is None:
        return None
    return OpenAIStub(pool, f"http://{gpu.endpoint.address}", gpu.name)


class OpenAIStub:
    """The V2 stub's ModelInfer and ModelStreamInfer for one OpenAI GPU at ``base_url``."""

    def __init__(self, pool: OpenAIPool, base_url: str, gpu: str) -> None:
        self.pool = pool
        self.base_url = base_url.rstrip("/")
        self.gpu = gpu

    def ModelInfer(
        self, request: pb.ModelInferRequest, *, metadata: Metadata, timeout: float | None
    ) -> UnaryCall:
        return UnaryCall(self.exchange(request, metadata, timeout))

    def ModelStreamInfer(
        self,
        requests: Iterable[pb.ModelInferRequest],
        *,
        metadata: Metadata,
        timeout: float | None,
    ) -> StreamCall:
        # The tier sends one request per child stream (x-meridian-single-request).
        (request,) = tuple(requests)
        return StreamCall(self, request, metadata, timeout)

    def call_of(self, request: pb.ModelInferRequest, stream: bool) -> OpenAICall:
        """The OpenAI request; INVALID_ARGUMENT when it cannot be put in OpenAI's terms."""
        try:
            return openai_call(request, stream=stream)
        except RouteError as exc:
            raise _rpc_error(exc.code, exc.message) from None

    async def exchange(
        self, request: pb.ModelInferRequest, metadata: Metadata, timeout: float | None
    ) -> pb.ModelInferResponse:
        """One unary exchange: the answer as a V2 response."""
        call = self.call_of(request, stream=False)
        async with self.translated(timeout), self.post(call, metadata, request, timeout) as answer:
            await self.check_status(answer)
            piece = answer_piece(parse_json(await answer.read()), call.chat)
        return v2_response(request, piece)

    def post(
        self,
        call: OpenAICall,
        metadata: Metadata,
        request: pb.ModelInferRequest,
        timeout: float | None,
    ) -> Any:
        """The HTTP request (an aiohttp request context manager)."""
        headers = {k: v for k, v in metadata if k in PASSED_HEADERS}
        if request.id:
            headers["x-request-id"] = request.id[:128]
        return self.pool.session.post(
            self.base_url + call.path,
            json=call.body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=CONNECT_TIMEOUT_S),
        )

    async def check_status(self, answer: aiohttp.ClientResponse) -> None:
        """Raise the gRPC error of an HTTP error status (429: with ``retry-after-ms``)."""
        if answer.status == 200:
            return
        detail = error_detail(await answer.read())
        trailers: tuple[tuple[str, str], ...] = ()
        if answer.status == 429:
            wait = retry_after_ms(answer.headers.get("Retry-After"))
            trailers = ((RETRY_AFTER_MS, str(wait if wait is not None else 1000)),)
        raise _rpc_error(
            grpc_code(answer.status),
            f"GPU {self.gpu} answered HTTP {answer.status}: {detail}",
            trailers,
        )

    @contextlib.asynccontextmanager
    async def translated(self, timeout: float | None) -> AsyncIterator[None]:
        """Failures of one HTTP exchange as the gRPC errors a V2 stub would raise."""
        gpu = self.gpu
        try:
            yield
        except BadAnswer as exc:
            detail = f"GPU {gpu} sent a bad answer: {exc}"
            raise _rpc_error(grpc.StatusCode.INTERNAL, detail) from None
        except TimeoutError:
            detail = f"GPU {gpu} did not answer within {timeout or 0:g} s"
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, detail) from None
        except (aiohttp.ClientError, OSError) as exc:
            detail = f"GPU {gpu}: {type(exc).__name__}: {exc}"
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, detail) from None
        except ValueError as exc:  # aiohttp: a line over MAX_LINE_BYTES
            raise _rpc_error(grpc.StatusCode.INTERNAL, f"GPU {gpu}: {exc}") from None


async def sse_pieces(response: aiohttp.ClientResponse, chat: bool) -> AsyncIterator[Piece]:
    """Each ``data:`` event of an SSE body as a ``Piece``, up to ``[DONE]`` or the usage
    chunk; a body that ends before either is a GPU that went away (UNAVAILABLE)."""
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event/id fields
        data = line[5:].strip()
        if data == _DONE:
            return
        doc = parse_json(data)
        failed = stream_error(doc)
        if failed is not None:
            raise _rpc_error(failed[0], f"the GPU failed mid-answer: {failed[1]}")
        piece = chunk_piece(doc, chat)
        yield piece
        if piece.usage is not None:
            return
    raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the GPU's stream ended before [DONE]")


def _rpc_error(
    code: grpc.StatusCode, detail: str, trailers: tuple[tuple[str, str], ...] = ()
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=detail
    )


class UnaryCall:
    """What ``ModelInfer`` returns: awaited, the response; then the (empty) trailers."""

    def __init__(self, exchange: Coroutine[Any, Any, pb.ModelInferResponse]) -> None:
        self._exchange = exchange

    def __await__(self) -> Generator[Any, None, pb.ModelInferResponse]:
        return self._exchange.__await__()

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class StreamCall:
    """What ``ModelStreamInfer`` returns: iterated, the request's stream responses, one
    per SSE chunk that carries text, the last (final) with the counts of ``usage``;
    ``cancel()`` closes the HTTP exchange at once (a no-op once it is over)."""

    def __init__(
        self,
        stub: OpenAIStub,
        request: pb.ModelInferRequest,
        metadata: Metadata,
        timeout: float | None,
    ) -> None:
        self.stub = stub
        self.request = request
        self.metadata = metadata
        self.timeout = timeout
        self._answer: aiohttp.ClientResponse | None = None

    def __aiter__(self) -> AsyncIterator[pb.ModelStreamInferResponse]:
        return self._responses()

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def cancel(self) -> bool:
        answer, self._answer = self._answer, None
        if answer is None or answer.closed:
            return False
        answer.close()  # the connection goes: the server stops generating
        return True

    async def _responses(self) -> AsyncIterator[pb.ModelStreamInferResponse]:
        stub, request = self.stub, self.request
        if not wants_stream(request):  # `stream: false`: the whole text in one response
            whole = await stub.exchange(request, self.metadata, self.timeout)
            whole.parameters["triton_final_response"].bool_param = True
            yield pb.ModelStreamInferResponse(infer_response=whole)
            return
        call = stub.call_of(request, stream=True)
        post = stub.post(call, self.metadata, request, self.timeout)
        async with stub.translated(self.timeout), post as answer:
            self._answer = answer
            await stub.check_status(answer)
            async for piece in sse_pieces(answer, call.chat):
                final = piece.usage is not None
                if piece.text or final:
                    out = v2_response(request, piece, final=final, text=bool(piece.text))
                    yield pb.ModelStreamInferResponse(infer_response=out)
                if final:
                    return
        # No usage chunk (a server that ignores include_usage): a bare final marker
        # ends the request, and the tiers bill their estimates.
        end = v2_response(request, Piece("", None, ""), final=True, text=False)
        yield pb.ModelStreamInferResponse(infer_response=end)
