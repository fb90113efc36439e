"""One request's stream responses on their way to the caller, coalesced while they wait.

A tier relays a child's responses as they come, but writing one to the caller costs
about as much as reading it, per message whatever it holds. So a request's responses
go into its ``Outbox``, and the stream's one writer (``common.request.streaming``)
takes what an outbox holds whenever it is ready to write: one response when it keeps
up (the low-load case: nothing waits, one message per token), several when responses
arrived while it was busy with an earlier write, which then go up as **one** message
(per-message cost falls as load rises).

Merging keeps the V2 generate convention, so stock clients read it unchanged: the
merged response is the last one of the run (its id, model, parameters — the counts
in them are totals so far, and ``triton_final_response``), whose ``text_output`` holds
the text of every response of the run, in order. Only plain text responses merge
(no ``error_message``, one output, ``text_output`` as one raw BYTES element); any
other response (an error, a bare final marker, Triton's per-response count tensors)
goes as it came, in order, after the run before it.

A child that reports no token counts: the tier above estimates the completion from
the number of token responses it got, which a merge would shrink. So from its first
merge on, an outbox writes the count of token responses it took in as the
``completion_tokens`` parameter of every response it sends (a merged response says
how many tokens it stands for).

What an outbox holds is bounded: past ``MAX_HELD`` responses the request stops reading
its child until the writer has taken them (gRPC flow control then holds the rest in
the child), so a caller that stops reading costs bounded memory until the stream's
write timeout ends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.gen.inference import grpc_service_pb2 as pb
from common.request.tokens import COMPLETION_TOKENS, USAGE
from common.request.v2 import TEXT_OUTPUT

# Responses one request may hold waiting for the writer before it stops reading its child.
MAX_HELD = 256

Response = pb.ModelStreamInferResponse


def _text_element(response: Response) -> bytes | None:
    """The raw ``text_output`` element of a plain text response, else None (not mergeable)."""
    if response.error_message:
        return None
    infer = response.infer_response
    if len(infer.outputs) != 1 or len(infer.raw_output_contents) != 1:
        return None
    output = infer.outputs[0]
    if output.name != TEXT_OUTPUT or output.datatype != "BYTES":
        return None
    raw = infer.raw_output_contents[0]
    if len(raw) < 4 or int.from_bytes(raw[:4], "little") != len(raw) - 4:
        return None
    return raw


def merge(run: list[Response]) -> Response:
    """One response for a run of plain text responses (see the module docstring): the
    last of them, its ``text_output`` the run's texts joined. Changes the last in place."""
    last = run[-1]
    texts = b"".join(r.infer_response.raw_output_contents[0][4:] for r in run)
    last.infer_response.raw_output_contents[0] = len(texts).to_bytes(4, "little") + texts
    return last


class Outbox:
    """One request's responses not yet written (see the module docstring).

    ``ready`` is the stream writer's: called with this outbox when its first response
    arrives, so the writer queues it. ``put`` is the request's write; the writer calls
    ``take`` for the next message and ``taken`` once it is written.
    """

    __slots__ = (
        "_ready",
        "_room",
        "closing",
        "lost",
        "parts",
        "responses",
        "since",
        "stamping",
        "writing",
    )

    def __init__(self, ready: Callable[[Outbox], None]) -> None:
        self.parts: list[Response] = []
        # When (loop time) the oldest response held arrived (the writer's window).
        self.since = 0.0
        # The request has ended: what is held goes without waiting for a window.
        self.closing = False
        # A message taken from here is being written.
        self.writing = False
        # A message taken from here never reached the caller (its write failed).
        self.lost = False
        # Token responses taken in, and whether counts are written on the way out.
        self.responses = 0
        self.stamping = False
        self._ready = ready
        self._room: asyncio.Future[None] | None = None

    async def put(self, response: Response) -> None:
        """Hold ``response`` for the writer; waits only when ``MAX_HELD`` are held."""
        parts = self.parts
        parts.append(response)
        if len(parts) == 1:
            self._ready(self)
        elif len(parts) >= MAX_HELD:
            await self._wait_room()

    def take(self) -> Response:
        """The next message to write: every plain text response held from the first on,
        merged, or the first alone when it is not one."""
        parts = self.parts
        first = parts[0]
        self.writing = True
        if len(parts) == 1 or _text_element(first) is None:
            del parts[0]  # the common case, one response per token: nothing to merge
            tokens = 1 if len(first.infer_response.outputs) else 0
            self.responses += tokens
            return self._stamped(first) if self.stamping and tokens else first
        n = 1
        while n < len(parts) and _text_element(parts[n]) is not None:
            n += 1
        run = parts[:n]
        del parts[:n]
        if n == 1:
            self.responses += 1
            return self._stamped(first) if self.stamping else first
        self.responses += n  # plain text responses: each carries output
        merged = merge(run)
        params = merged.infer_response.parameters
        if COMPLETION_TOKENS not in params and USAGE not in params:
            self.stamping = True
        return self._stamped(merged) if self.stamping else merged

    def _stamped(self, response: Response) -> Response:
        response.infer_response.parameters[COMPLETION_TOKENS].int64_param = self.responses
        return response

    def taken(self, written: bool = True) -> None:
        """The message ``take`` gave was written (``written`` False: its write failed,
        the caller never got it): a request waiting for room goes on."""
        self.writing = False
        if not written:
            self.lost = True
        room = self._room
        if room is not None and not room.done():
            room.set_result(None)

    @property
    def drained(self) -> bool:
        return not self.parts and not self.writing

    async def wait_drained(self) -> None:
        """Until everything put here was written (or the stream ended: cancelled)."""
        while not self.drained:
            await self._wait_room()

    async def _wait_room(self) -> None:
        self._room = asyncio.get_running_loop().create_future()
        try:
            await self._room
        finally:
            self._room = None
