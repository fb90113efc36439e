"""What the forwarding loop sends and tells: one attempt, the metadata below, tracing.

``common.request.forwarding.Forwarder`` retries an ``Attempt`` over its balancer's
children; a unary call is ``UnaryAttempt``, a request of a stream
``common.request.stream_request.StreamRequestAttempt``, and the simulator has its
own (``sim.flow``), which runs the tier below in simulated time. ``Downstream`` is
what the loop puts in the metadata of each attempt (``RouteHints``), and
``AttemptTracing`` the spans it opens around decisions and attempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import grpc
from opentelemetry.trace import Span

from common.basics.geo import GeoPoint
from common.gen.inference import grpc_service_pb2 as pb
from common.request.balancer import Lease
from common.request.children import Child
from common.request.tokens import TokenCount

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
Metadata = list[tuple[str, str]]


class Attempt(Protocol[T_co]):
    """One call sent to one child: what ``Forwarder.forward`` retries."""

    method: str

    @property
    def committed(self) -> bool:
        """A response byte went back to the caller: the call can no longer fail over."""
        ...

    @property
    def reported_completion(self) -> int | None:
        """The answer's length in tokens as the child reported it, once answered
        (None: not reported, or not answered yet)."""
        ...

    async def send(
        self, child: Child, metadata: Metadata, timeout: float | None
    ) -> tuple[T_co, Any]:
        """The child's answer and its trailers; raises ``grpc.aio.AioRpcError``."""
        ...


@dataclass
class UnaryAttempt(Generic[T]):
    """A unary call: nothing reaches the caller before the child has answered."""

    method: str
    request: Any
    committed: bool = False
    # What the child's answer reported of the request's tokens (an inference answer's).
    count: TokenCount = field(default_factory=TokenCount)

    @property
    def reported_completion(self) -> int | None:
        return self.count.completion

    async def send(self, child: Child, metadata: Metadata, timeout: float | None) -> tuple[T, Any]:
        assert child.stub is not None
        call = getattr(child.stub, self.method)(self.request, metadata=metadata, timeout=timeout)
        response = await call
        if isinstance(response, pb.ModelInferResponse):
            self.count.add(response)
        # A tuple, iterated several times below (route, capacity hint, load, passed up),
        # where grpc's Metadata iterates through a generator each time.
        return response, tuple(await call.trailing_metadata())


class Downstream(Protocol):
    """What a request tells the tier below (``RouteHints``; the simulator sends none)."""

    @property
    def attempt(self) -> int: ...

    def downstream_metadata(
        self, origin: GeoPoint | None, attempt: int, prefix_blocks: tuple[int, ...] = ()
    ) -> Metadata: ...


class AttemptTracing(Protocol):
    """The spans of decisions and attempts (``common.observability.tracing.TierTracing``)."""

    def decision_started(self, parent: Span) -> int: ...

    def record_decision(
        self,
        parent: Span,
        started: int,
        lease: Lease | None = None,
        code: grpc.StatusCode = grpc.StatusCode.OK,
    ) -> None: ...

    def begin_attempt(self, method: str, lease: Lease, attempt: int, parent: Span) -> None: ...

    def end_attempt(
        self, lease: Lease, code: grpc.StatusCode, detail: str, elapsed: float
    ) -> None: ...

    def child_metadata(self, metadata: Metadata, lease: Lease, parent: Span) -> Metadata: ...
