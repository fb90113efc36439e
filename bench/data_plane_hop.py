"""The floor for a Python hop: a grpc.aio server that passes raw bytes through.

No protobuf, no picking, no metadata: every call (unary or bidirectional stream, any
method) goes to the next upstream in turn, bytes in and bytes out, its status copied
back. ``bench.data_plane`` runs it as a process of its own (``python -m
bench.data_plane_hop``), alone in front of the GPUs and three in series, so a Meridian
tier is compared with the least a Python hop on the same grpcio can cost. With
``--tls-*`` it serves mutual TLS and/or dials its upstream over TLS, as the tier it
stands in for does.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc


class BareHop:
    """Serves ``listen``; forwards each call to ``upstreams`` round robin."""

    def __init__(
        self,
        listen: str,
        upstreams: list[str],
        *,
        server_credentials: grpc.ServerCredentials | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.listen = listen
        self.upstreams = upstreams
        self.server_credentials = server_credentials
        self.channel_credentials = channel_credentials
        self.port = 0

    async def start(self) -> None:
        creds = self.channel_credentials
        self._channels = [
            grpc.aio.insecure_channel(u) if creds is None else grpc.aio.secure_channel(u, creds)
            for u in self.upstreams
        ]
        self._next = itertools.cycle(self._channels)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers([_Handler(self)])
        if self.server_credentials is None:
            self.port = self._server.add_insecure_port(self.listen)
        else:
            self.port = self._server.add_secure_port(self.listen, self.server_credentials)
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(0)
        for channel in self._channels:
            await channel.close()

    async def unary(self, method: str, request: bytes, context: Any) -> bytes:
        call = next(self._next).unary_unary(method)
        try:
            reply: bytes = await call(request)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        return reply

    async def stream(
        self, method: str, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        call = next(self._next).stream_stream(method)(requests)
        try:
            async for reply in call:
                yield reply
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")


class _Handler(grpc.GenericRpcHandler):
    """Every method: unary, except the one bidirectional stream of KServe V2."""

    def __init__(self, hop: BareHop) -> None:
        self.hop = hop

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.endswith("/ModelStreamInfer"):
            # grpc.aio streams the replies of an async generator *function* only.
            async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
                async for reply in self.hop.stream(method, requests, context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(stream)

        async def unary(request: bytes, context: Any) -> bytes:
            return await self.hop.unary(method, request, context)

        return grpc.unary_unary_rpc_method_handler(unary)


def credentials(
    args: argparse.Namespace,
) -> tuple[grpc.ServerCredentials | None, grpc.ChannelCredentials | None]:
    """From ``--tls-ca/--tls-cert/--tls-key``: mutual TLS served (``--tls-serve``) and
    TLS with the same certificate to the upstream (``--tls-upstream``)."""
    if not (args.tls_serve or args.tls_upstream):
        return None, None
    ca, cert, key = (Path(p).read_bytes() for p in (args.tls_ca, args.tls_cert, args.tls_key))
    server = (
        grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        if args.tls_serve
        else None
    )
    channel = (
        grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
        if args.tls_upstream
        else None
    )
    return server, channel


async def serve(args: argparse.Namespace) -> None:
    server, channel = credentials(args)
    hop = BareHop(
        args.listen,
        args.upstream.split(","),
        server_credentials=server,
        channel_credentials=channel,
    )
    await hop.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"bare hop on {args.listen} -> {args.upstream}", flush=True)
    await stop.wait()
    await hop.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT[,HOST:PORT...]")
    parser.add_argument("--tls-ca", metavar="FILE")
    parser.add_argument("--tls-cert", metavar="FILE")
    parser.add_argument("--tls-key", metavar="FILE")
    parser.add_argument("--tls-serve", action="store_true", help="serve mutual TLS")
    parser.add_argument("--tls-upstream", action="store_true", help="dial upstreams over TLS")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
