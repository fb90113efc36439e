"""One way to build a Meridian gRPC server: V2 service, grpc.health.v1, reflection.

Size limits (``common.config.Limits``) are gRPC server options, so gRPC refuses
an oversized request before any Meridian code runs, and the caller gets
RESOURCE_EXHAUSTED from gRPC itself:

* a message over ``max_message_bytes``: ``SERVER: Received message larger than
  max (<got> vs. <limit>)``;
* request headers over ``max_metadata_bytes``: ``received metadata size exceeds
  hard limit (...)``. gRPC has a soft limit (``grpc.max_metadata_size``, above
  which it refuses a *random share* of requests) and a hard one
  (``grpc.absolute_max_metadata_size``); both are set to the same value so the
  limit is exact, not probabilistic.

Every server and channel runs gRPC keepalive (``common.request.keepalive``), so a
hung peer is found within ``time_s + timeout_s`` (2 s between tiers).

No server announces an HTTP/2 stream limit a client could meet
(``grpc.max_concurrent_streams`` is 2^31-1, as Envoy's): a client may open streams
before it has read the server's SETTINGS, and streams over a smaller limit would be
reset with REFUSED_STREAM, which a stock client reports as UNAVAILABLE. At the edge
(the client-facing server) ``max_streams_per_connection`` bounds a connection's calls
at once instead, by queueing (``common.request.per_connection``). Inner tiers leave
it unbounded: all traffic from the tier above shares one connection, bounded by the
tenants' limits already.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config.access import GRPC_MAX_LIMIT, Limits
from common.config.liveness import Keepalive
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.keepalive import keepalive_channel_args, keepalive_server_args
from common.request.per_connection import ConnectionSlots, ConnectionSlotsInterceptor
from common.request.replicas import REPLICA_HEALTH

V2_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Responses (generated text) a tier accepts from its children.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def server_options(
    limits: Limits,
    keepalive: Keepalive | None = None,
    *,
    reuse_port: bool = False,
) -> list[tuple[str, int]]:
    """gRPC server options enforcing ``limits`` and ``keepalive`` (default: between
    tiers); see the module docstring. ``reuse_port``: share the port with the other
    workers of this tier (``Endpoint.reuse_port``)."""
    return [
        ("grpc.max_concurrent_streams", GRPC_MAX_LIMIT),
        # grpcio turns SO_REUSEPORT on by default, so a second server on a taken port
        # would start silently and share it; a router must fail loudly instead. Only the
        # workers of one tier process share it, on purpose (cli.workers checks that the
        # port was free before they start).
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_metadata_size", limits.max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", limits.max_metadata_bytes),
        *keepalive_server_args(keepalive or Keepalive()),
    ]


CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A tier forwards only what its own server accepted; the child's server
    # enforces its own limit, so the sending side adds none.
    ("grpc.max_send_message_length", -1),
    # Reconnect quickly after a child restarts: the default backoff grows to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    # A restarted child is usable again within a quarter second (measured: with 1 s, a
    # GPU's return took up to 1.5 s to reach the global tier).
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 100),
]


def channel_options(keepalive: Keepalive) -> list[tuple[str, int]]:
    """``CHANNEL_OPTIONS`` with ``keepalive``: what a tier dials its children with."""
    return [*CHANNEL_OPTIONS, *keepalive_channel_args(keepalive)]


def dial(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, str | int]],
) -> grpc.aio.Channel:
    """A channel to ``address`` (a target: ``host:port``, ``dns:///host:port``): TLS
    with ``credentials``, plaintext without."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


class V2Server:
    """A grpc.aio server serving a V2 servicer plus health and reflection.

    ``start()`` binds (port 0 picks a free port; ``port`` tells which) and
    ``stop(grace)`` stops accepting, lets in-flight calls finish for ``grace``
    seconds, then cancels the rest. With ``credentials`` the port serves TLS
    (see ``common.config.tls``), else plaintext. ``limits`` bounds message and
    metadata sizes (default: ``Limits()``, 4 MiB and 16 KiB). ``interceptors``
    wrap every handler (``common.request.call.CallInterceptor`` records inference calls).
    ``keepalive``: how it pings its callers (default: as between tiers).
    ``edge``: the client-facing server, which caps calls per connection (by queueing).
    """

    def __init__(
        self,
        servicer: pb_grpc.GRPCInferenceServiceServicer,
        endpoint: Endpoint,
        *,
        credentials: grpc.ServerCredentials | None = None,
        limits: Limits | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        keepalive: Keepalive | None = None,
        edge: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.credentials = credentials
        self.limits = limits or Limits()
        self.port = endpoint.port
        self.health = health.aio.HealthServicer()
        self._server = grpc.aio.server(
            options=server_options(self.limits, keepalive, reuse_port=endpoint.reuse_port),
            interceptors=[*self._edge_interceptors(edge), *interceptors],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._services = [V2_SERVICE, health.SERVICE_NAME]

    def _edge_interceptors(self, edge: bool) -> list[grpc.aio.ServerInterceptor]:
        """The edge's cap on calls per connection, first: a waiting call runs nothing.
        None at the default cap (2^31-1 calls, more than any connection can open): no
        call would ever wait, so no call pays for the count."""
        limits = self.limits
        if not edge or limits.max_streams_per_connection >= GRPC_MAX_LIMIT:
            return []
        slots = ConnectionSlots(
            limits.max_streams_per_connection, limits.max_queued_calls_per_connection
        )
        return [ConnectionSlotsInterceptor(slots)]

    def add_service(self, register: Callable[[grpc.aio.Server], None], name: str) -> None:
        """Serve another service (``name`` is its full name, for reflection); before start."""
        register(self._server)
        self._services.append(name)

    @property
    def address(self) -> str:
        return Endpoint(self.endpoint.host, self.port).address

    async def start(self) -> None:
        reflection.enable_server_reflection(
            (*self._services, reflection.SERVICE_NAME), self._server
        )
        if self.credentials is None:
            self.port = self._server.add_insecure_port(self.endpoint.address)
        else:
            self.port = self._server.add_secure_port(self.endpoint.address, self.credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.endpoint.address}: address in use or invalid")
        # Calls may come as soon as it listens (the tier above says whether to send).
        await self.health.set(REPLICA_HEALTH, _status(True))
        await self._server.start()

    async def set_serving(self, serving: bool) -> None:
        """Whether this server takes requests (``""`` and the V2 service: what the tier
        above watches); it takes calls as a replica meanwhile (``REPLICA_HEALTH``)."""
        await self.health.set("", _status(serving))
        await self.health.set(V2_SERVICE, _status(serving))

    async def stop_serving(self) -> None:
        """NOT_SERVING for good: as a replica first (each parent's channel stops
        sending here: ``common.request.replicas``), then as a whole."""
        await self.health.set(REPLICA_HEALTH, _status(False))
        await self.set_serving(False)

    async def stop(self, grace: float) -> None:
        await self.stop_serving()
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    if serving:
        return health_pb2.HealthCheckResponse.SERVING
    return health_pb2.HealthCheckResponse.NOT_SERVING
