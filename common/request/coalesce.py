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

**A caller that reads slowly, or not at all, costs bounded memory and no capacity
below.** The request keeps reading its child while the writer waits on the caller: at
``MAX_HELD`` responses held, the plain text responses held are merged in place (as the
writer would merge them), so the request goes on reading its child to the end of its
answer and gives back its lease (the GPU slot) in the answer's normal generation time,
while its record waits for the writes (``common.request.stream_request``). Only when
the text held passes ``held_bytes`` (``MAX_HELD_TEXT_BYTES``: a whole answer at the
longest ``max_tokens`` a request may ask, at 32 bytes a token), or ``MAX_HELD``
responses that cannot merge are held, does the request stop reading its child until the
writer has taken them (gRPC flow control then holds the rest in the child). So one
request in flight holds at most ``held_bytes`` of text plus ``MAX_HELD`` responses (and
the one response that crossed the bound), until the stream's write timeout ends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.gen.inference import grpc_service_pb2 as pb
from common.request.tokens import COMPLETION_TOKENS, USAGE
from common.request.v2 import MAX_TOKENS_LIMIT, TEXT_OUTPUT

# Responses one request holds waiting for the writer before merging the text ones held.
MAX_HELD = 256
# Text one request may hold for the writer before it stops reading its child: a whole
# answer at the longest max_tokens, at 32 bytes a token (an English token is ~4).
MAX_HELD_TEXT_BYTES = MAX_TOKENS_LIMIT * 32

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


def mergeable(response: Response) -> bool:
    """Whether ``response`` is a plain text response (``merge`` takes only those)."""
    return _text_element(response) is not None


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
    ``take`` for the next message and ``taken`` once it is written. ``weights[i]`` is
    how many token responses ``parts[i]`` stands for (more than one once merged while
    held).
    """

    __slots__ = (
        "_ready",
        "_room",
        "closing",
        "held_bytes",
        "lost",
        "parts",
        "responses",
        "since",
        "stamping",
        "weights",
        "writing",
    )

    def __init__(
        self, ready: Callable[[Outbox], None], *, held_bytes: int = MAX_HELD_TEXT_BYTES
    ) -> None:
        self.parts: list[Response] = []
        self.weights: list[int] = []
        self.held_bytes = held_bytes
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
        """Hold ``response`` for the writer; at ``MAX_HELD`` held, merges the text ones
        held, and waits only while what it holds is over the bounds."""
        parts = self.parts
        parts.append(response)
        self.weights.append(1 if len(response.infer_response.outputs) else 0)
        if len(parts) == 1:
            self._ready(self)
        elif len(parts) >= MAX_HELD:
            self._compact()
            while self.parts and self._over():
                await self._wait_room()

    def _over(self) -> bool:
        if len(self.parts) >= MAX_HELD:
            return True
        text = 0
        for part in self.parts:
            raw = _text_element(part)
            text += len(raw) if raw is not None else 0
        return text > self.held_bytes

    def _compact(self) -> None:
        """Merge every run of plain text responses held into one (what ``take`` would
        send for it), keeping order and the token responses each stands for."""
        parts, weights = self.parts, self.weights
        kept: list[Response] = []
        kept_weights: list[int] = []
        run: list[Response] = []
        run_weight = 0
        for part, weight in zip(parts, weights, strict=True):
            if _text_element(part) is not None:
                run.append(part)
                run_weight += weight
                continue
            if run:
                kept.append(merge(run) if len(run) > 1 else run[0])
                kept_weights.append(run_weight)
                run, run_weight = [], 0
            kept.append(part)
            kept_weights.append(weight)
        if run:
            kept.append(merge(run) if len(run) > 1 else run[0])
            kept_weights.append(run_weight)
        parts[:] = kept
        weights[:] = kept_weights

    def take(self) -> Response:
        """The next message to write: every plain text response held from the first on,
        merged, or the first alone when it is not one."""
        parts, weights = self.parts, self.weights
        first = parts[0]
        self.writing = True
        n = 1
        if len(parts) > 1 and _text_element(first) is not None:
            while n < len(parts) and _text_element(parts[n]) is not None:
                n += 1
        tokens = sum(weights[:n]) if n > 1 else weights[0]
        response = merge(parts[:n]) if n > 1 else first
        del parts[:n]
        del weights[:n]
        self.responses += tokens
        if tokens > 1 and not self.stamping:  # it stands for several token responses
            params = response.infer_response.parameters
            self.stamping = COMPLETION_TOKENS not in params and USAGE not in params
        return self._stamped(response) if self.stamping and tokens else response

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
