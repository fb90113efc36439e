"""What the emulated GPU's V2 stream writes: a request's token responses that waited
together for the writer go as one, as vLLM does for a consumer that falls behind.

vLLM's engine hands a request's outputs to the task that streams them through a
per-request collector that merges the outputs still waiting when the next arrives
(``RequestOutputCollector`` in ``vllm/v1/engine/output_processor.py``): a server
whose writer keeps up sends one message per token, one whose writer lags (a busy CPU,
a slow reader) sends fewer, longer ones, and its generation never waits for the
writer. ``merged_while_waiting`` does the same for the emulated GPU's stream queue,
once its writer has fallen ``BEHIND`` responses back (a writer that keeps up, or is a
few tokens late, still sends one response per token, as the tests of the tiers above
expect): the responses waiting behind the one about to be written are merged into it
while they belong to the same request (same id, the earlier not final) and each is a
plain text response carrying the counts so far (``common.request.coalesce.merge``:
texts joined, the last one's counts and final flag). A request's first token goes
alone (its time to first token is what a caller measures), and a GPU that reports no
counts sends one response per token, since the tiers above estimate its completion
from their number. Nothing is dropped or reordered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from common.gen.inference import grpc_service_pb2 as pb
from common.request.coalesce import merge, mergeable
from common.request.tokens import COMPLETION_TOKENS
from common.request.v2 import FINAL_RESPONSE

Response = pb.ModelStreamInferResponse
# Responses waiting for the writer from which those of one request merge.
BEHIND = 8


def _joins(last: Response, following: Response) -> bool:
    """Whether ``following`` merges into a run ending with ``last``."""
    a, b = last.infer_response, following.infer_response
    if a.id != b.id or not (mergeable(last) and mergeable(following)):
        return False
    final = a.parameters.get(FINAL_RESPONSE)
    if final is not None and final.bool_param:
        return False
    done = a.parameters.get(COMPLETION_TOKENS)
    return done is not None and done.int64_param > 1 and COMPLETION_TOKENS in b.parameters


async def merged_while_waiting(out: asyncio.Queue[Response | None]) -> AsyncIterator[Response]:
    """The responses ``out`` holds until its end (None), merged as the module docstring
    says."""
    following: Response | None = None
    have_following = False
    while True:
        first = following if have_following else await out.get()
        have_following = False
        if first is None:
            return
        run = [first]
        while out.qsize() >= BEHIND or (len(run) > 1 and not out.empty()):
            waiting = out.get_nowait()
            if waiting is not None and _joins(run[-1], waiting):
                run.append(waiting)
                continue
            following, have_following = waiting, True
            break
        yield merge(run) if len(run) > 1 else first
