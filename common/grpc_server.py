"""One way to build a Meridian gRPC server: V2 service, grpc.health.v1, reflection."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc

V2_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# grpcio turns SO_REUSEPORT on by default, so a second server on a taken port
# would start silently and share it; a router must fail loudly instead.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a child restarts: the default backoff grows to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 100),
]


class V2Server:
    """A grpc.aio server serving a V2 servicer plus health and reflection.

    ``start()`` binds (port 0 picks a free port; ``port`` tells which) and
    ``stop(grace)`` stops accepting, lets in-flight calls finish for ``grace``
    seconds, then cancels the rest. With ``credentials`` the port serves TLS
    (see ``common.tls``), else plaintext.
    """

    def __init__(
        self,
        servicer: pb_grpc.GRPCInferenceServiceServicer,
        endpoint: Endpoint,
        *,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.credentials = credentials
        self.port = endpoint.port
        self.health = health.aio.HealthServicer()
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (V2_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )

    @property
    def address(self) -> str:
        return Endpoint(self.endpoint.host, self.port).address

    async def start(self) -> None:
        if self.credentials is None:
            self.port = self._server.add_insecure_port(self.endpoint.address)
        else:
            self.port = self._server.add_secure_port(self.endpoint.address, self.credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.endpoint.address}: address in use or invalid")
        await self._server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)
        await self.health.set(V2_SERVICE, status)

    async def stop(self, grace: float) -> None:
        await self.set_serving(False)
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
