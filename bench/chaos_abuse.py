"""Slow readers: ModelStreamInfer streams that send one request and never read.

``UnreadStreams`` opens ``count`` streams for one tenant, spread over ``channels``
connections (each channel its own subchannel pool, so its own HTTP/2 connection): each
sends one token-streaming request and then neither reads a response nor half-closes,
holding the stream open, until ``close()`` cancels them all (with ``read``, a control:
the same load from callers that keep up, each stream is read as it comes). What the
server did with them meanwhile shows at ``close()``: streams it had already ended, and
with which status.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc

from bench.chaos_load import CITIES, MODEL, metadata_for, prompt, traceparent
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request


class UnreadStreams:
    """``count`` open, never-read streams of tenant ``key``'s; ``open()`` / ``close()``."""

    def __init__(
        self,
        target: str,
        key: str,
        *,
        count: int,
        channels: int,
        max_tokens: int,
        rng: random.Random,
        read: bool = False,
    ) -> None:
        self.target = target
        self.read = read
        self.key = key
        self.count = count
        self.channel_count = max(1, channels)
        self.max_tokens = max_tokens
        self.rng = rng
        self.release = asyncio.Event()
        self.channels: list[grpc.aio.Channel] = []
        self.calls: list[Any] = []
        self.readers: list[asyncio.Task[None]] = []

    async def _requests(self, request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferRequest]:
        yield request
        await self.release.wait()  # never half-close: the stream stays open

    def open(self) -> None:
        """Start every stream (grpc.aio starts a call when it is made; nothing is read)."""
        for i in range(self.channel_count):
            options = [("grpc.use_local_subchannel_pool", 1), ("chaos.channel", i)]
            self.channels.append(grpc.aio.insecure_channel(self.target, options=options))
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in self.channels]
        for i in range(self.count):
            _, parent = traceparent()
            city = self.rng.choice(list(CITIES))
            request = generate_request(
                MODEL, prompt(self.rng, 12), self.max_tokens, request_id=f"unread-{i}", stream=True
            )
            metadata = metadata_for(self.key, city, parent)
            stub = stubs[i % len(stubs)]
            call = stub.ModelStreamInfer(self._requests(request), metadata=metadata, timeout=600)
            self.calls.append(call)
            if self.read:
                self.readers.append(asyncio.create_task(_read_all(call)))

    async def ended_by_server(self) -> Counter[str]:
        """Streams that ended before ``close()``, by status (a server that bounds them).
        A done call's status is already there: asking for it reads no message."""
        ended: Counter[str] = Counter()
        for call in self.calls:
            if call.done() and not call.cancelled():
                ended[(await call.code()).name] += 1
        return ended

    async def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        self.readers.clear()
        for channel in self.channels:
            await channel.close(grace=None)
        self.channels.clear()
        self.calls.clear()


async def _read_all(call: Any) -> None:
    """Read one stream's responses as they come (the stream stays open: its caller never
    half-closes), until it ends or is cancelled."""
    with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
        async for _ in call:
            pass
