"""A small synchronous V2 client for tests (grpcio's own stub, nothing mocked)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE, trailer
from common.request.tokens import TokenCount
from common.request.v2 import generate_request, response_text


@dataclass
class Reply:
    text: str
    route: str
    trailers: dict[str, str]


class V2Client:
    """Blocking client over one channel; ``close()`` when done."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> V2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(
        self,
        prompt: str = "hello there",
        max_tokens: int = 4,
        *,
        model: str = "demo-llm",
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float = 30.0,
        request: pb.ModelInferRequest | None = None,
    ) -> Reply:
        request = request or generate_request(model, prompt, max_tokens)
        response, call = self.stub.ModelInfer.with_call(
            request, metadata=tuple(metadata), timeout=timeout
        )
        trailers = call.trailing_metadata()
        return Reply(response_text(response), trailer(trailers, ROUTE) or "", dict(trailers))

    def stream(
        self,
        requests: Sequence[pb.ModelInferRequest],
        *,
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float = 30.0,
    ) -> tuple[list[pb.ModelStreamInferResponse], str]:
        call = self.stub.ModelStreamInfer(iter(requests), metadata=tuple(metadata), timeout=timeout)
        responses = list(call)
        return responses, trailer(call.trailing_metadata(), ROUTE) or ""


def region_of(route: str) -> str:
    return route.split("/")[0]


def zone_of(route: str) -> str:
    return route.split("/")[1]


def expect_code(
    code: grpc.StatusCode, fn: object, *args: object, **kwargs: object
) -> grpc.RpcError:
    """Call ``fn`` and return its error, asserting the exact status code."""
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except grpc.RpcError as err:
        assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
        return err
    raise AssertionError(f"expected {code.name}, the call succeeded")


def iter_requests(*requests: pb.ModelInferRequest) -> Iterator[pb.ModelInferRequest]:
    yield from requests


@dataclass
class Sample:
    started: float
    ended: float
    code: grpc.StatusCode
    route: str


class LoadLoop:
    """Closed-loop background load from ``clients`` threads; bounded by ``max_requests``."""

    def __init__(
        self,
        address: str,
        metadata: Sequence[tuple[str, str]],
        *,
        clients: int = 4,
        max_requests: int = 5000,
        max_tokens: int = 4,
    ) -> None:
        import threading

        self.address = address
        self.metadata = tuple(metadata)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> LoadLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self) -> None:
        import time

        with V2Client(self.address) as client:
            while not self._stop.is_set() and len(self.samples) < self.max_requests:
                start = time.monotonic()
                try:
                    reply = client.infer(
                        "load", self.max_tokens, metadata=self.metadata, timeout=10
                    )
                    sample = Sample(start, time.monotonic(), grpc.StatusCode.OK, reply.route)
                except grpc.RpcError as err:
                    sample = Sample(start, time.monotonic(), err.code(), "")
                with self._lock:
                    self.samples.append(sample)

    def since(self, t: float) -> list[Sample]:
        with self._lock:
            return [s for s in self.samples if s.started >= t]

    def failures(self) -> list[Sample]:
        with self._lock:
            return [s for s in self.samples if s.code != grpc.StatusCode.OK]


def gpu_metric(fleet: object, name: str) -> float:
    """``name`` summed over every label set on every emulated GPU's /metrics in ``fleet``."""
    import urllib.request

    total = 0.0
    for region in fleet.topology.regions:  # type: ignore[attr-defined]
        for zone in region.zones:
            for gpu in zone.gpus:
                url = f"http://{gpu.metrics_endpoint.address}/metrics"
                with urllib.request.urlopen(url, timeout=5) as reply:
                    for line in reply.read().decode().splitlines():
                        if line.startswith((f"{name}{{", f"{name} ")):
                            total += float(line.rsplit(" ", 1)[1])
    return total


def streamed_tokens(responses: Sequence[pb.ModelInferResponse]) -> int:
    """The tokens a stream's responses carried, as the tiers count them: what the GPU
    reported (or a relay that joined responses while its writer was busy, which says
    how many it joined), else one per response."""
    count = TokenCount()
    for response in responses:
        count.add(response)
    return len(responses) if count.completion is None else count.completion
