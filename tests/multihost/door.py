"""A door into a host: Unix sockets that relay, byte for byte, to TCP addresses on that host.

The harness (pytest, the benchmark) runs in the machine's own network namespace, which has
no address in the hosts' private network. A Unix socket is a file, not a network address,
so it works across namespaces: this relay runs inside a host's namespace, listens on one
socket file per target and copies bytes both ways, so a stock gRPC client dialling
``unix:<path>`` is a client on that host (its TCP connection starts there). The relay adds
no protocol of its own: HTTP/2, keepalive PINGs and RST_STREAMs pass through unchanged.

    python -m tests.multihost.door PATH=HOST:PORT [PATH=HOST:PORT ...]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.close()


def _relay_to(host: str, port: int):  # type: ignore[no-untyped-def]
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return relay


async def serve(mapping: dict[str, tuple[str, int]]) -> None:
    servers = []
    for path, (host, port) in mapping.items():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        servers.append(await asyncio.start_unix_server(_relay_to(host, port), path=path))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def parse(args: list[str]) -> dict[str, tuple[str, int]]:
    mapping = {}
    for arg in args:
        path, _, target = arg.partition("=")
        host, _, port = target.rpartition(":")
        mapping[path] = (host, int(port))
    return mapping


if __name__ == "__main__":
    asyncio.run(serve(parse(sys.argv[1:])))
