"""The floor a tier is measured against: a grpc.aio pass-through of raw bytes.

Every method (unary or bidirectional stream) is forwarded untouched — no parsing,
no metadata, no retries — to the next of ``--upstream`` in turn, with the caller's
invocation metadata and deadline. It serves and dials TLS where a tier in the same
position would (``--serve-cert`` / ``--dial-cert``: mutual TLS with the fleet's CA),
so a tier and its bare hop pay the same handshake and record costs.

    python -m bench.hop_bare --listen 127.0.0.1:9000 --upstream 127.0.0.1:9100,127.0.0.1:9101
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

from cli.processes import die_with_parent


def _pair(prefix: str | None) -> tuple[bytes, bytes] | None:
    """``PREFIX`` names ``PREFIX/key.pem`` and ``PREFIX/cert.pem`` (the fleet PKI's layout)."""
    if prefix is None:
        return None
    return (Path(prefix, "key.pem").read_bytes(), Path(prefix, "cert.pem").read_bytes())


class Passthrough(grpc.GenericRpcHandler):
    def __init__(self, channels: list[grpc.aio.Channel]) -> None:
        self.next = itertools.cycle(channels).__next__

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.endswith("StreamInfer"):

            async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
                call = self.next().stream_stream(method)(
                    requests,
                    metadata=context.invocation_metadata(),
                    timeout=context.time_remaining(),
                )
                async for reply in call:
                    yield reply

            return grpc.stream_stream_rpc_method_handler(stream)

        async def unary(request: bytes, context: Any) -> bytes:
            call = self.next().unary_unary(method)(
                request, metadata=context.invocation_metadata(), timeout=context.time_remaining()
            )
            reply: bytes = await call
            context.set_trailing_metadata(await call.trailing_metadata())
            return reply

        return grpc.unary_unary_rpc_method_handler(unary)


async def serve(
    args: argparse.Namespace,
    ca: bytes | None,
    dial: tuple[bytes, bytes] | None,
    own: tuple[bytes, bytes] | None,
) -> None:
    creds = None if dial is None else grpc.ssl_channel_credentials(ca, dial[0], dial[1])
    channels = [
        grpc.aio.insecure_channel(a) if creds is None else grpc.aio.secure_channel(a, creds)
        for a in args.upstream.split(",")
    ]
    server = grpc.aio.server(handlers=[Passthrough(channels)])
    if own is None:
        server.add_insecure_port(args.listen)
    else:
        tls = grpc.ssl_server_credentials([own], root_certificates=ca, require_client_auth=True)
        server.add_secure_port(args.listen, tls)
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)
    for channel in channels:
        await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--upstream", required=True, help="comma-separated host:port")
    parser.add_argument("--ca", help="the fleet CA (PEM) both sides verify against")
    parser.add_argument("--serve-cert", help="directory with cert.pem/key.pem: serve mutual TLS")
    parser.add_argument("--dial-cert", help="directory with cert.pem/key.pem: dial mutual TLS")
    args = parser.parse_args()
    die_with_parent()  # the bench's PR_SET_PDEATHSIG, as every launched tier asks
    ca = Path(args.ca).read_bytes() if args.ca else None
    asyncio.run(serve(args, ca, _pair(args.dial_cert), _pair(args.serve_cert)))


if __name__ == "__main__":
    main()
