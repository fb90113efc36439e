"""What the emulated GPU answers: how long its answer is and what it says it cost.

A real model ends its answer when it emits an end-of-sequence token, often long
before ``max_tokens``. The emulated model has no such thing; a request may ask for
one with the parameter ``sim_answer_tokens`` (an integer >= 1): the answer ends
after that many tokens, or at ``max_tokens`` if that comes first. Without it the
answer is ``max_tokens`` long, as before. Tiers forward the parameter untouched.

Every response carries the request's real counts so far as the response
parameters ``prompt_tokens`` and ``completion_tokens`` (``common.request.tokens``)
— on a stream, every response, so the last one holds the totals — unless the
GPU's ``report_tokens`` is false (a server that reports nothing, for tests and
demos of the estimates).
"""

from __future__ import annotations

from common.basics.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.request.tokens import put_counts
from common.request.v2 import GenerateRequest, param_int, text_response

ANSWER_TOKENS = "sim_answer_tokens"


def answer_length(request: pb.ModelInferRequest, gen: GenerateRequest) -> int:
    """Tokens the answer has: ``sim_answer_tokens`` capped at ``max_tokens``, else
    ``max_tokens``; RouteError (INVALID_ARGUMENT) when the parameter is not >= 1."""
    param = request.parameters.get(ANSWER_TOKENS)
    if param is None:
        return gen.max_tokens
    length = param_int(param, f"parameter '{ANSWER_TOKENS}'")
    if length < 1:
        raise RouteError.invalid(f"parameter '{ANSWER_TOKENS}' must be >= 1, got {length}")
    return min(length, gen.max_tokens)


def answer(
    request: pb.ModelInferRequest,
    gen: GenerateRequest,
    text: str,
    generated: int,
    *,
    report: bool,
    final: bool | None = None,
) -> pb.ModelInferResponse:
    """A response with ``text``; with ``report``, the prompt's tokens and the
    ``generated`` tokens so far (the emulated tokenizer: whitespace words)."""
    response = text_response(request, text, final=final)
    if report:
        put_counts(response, gen.prompt_tokens, generated)
    return response


def stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    # The V2 error response has no id field; name the request so a multiplexed
    # stream's client can tell which one failed.
    if request.id:
        message = f"{message} (request id {request.id!r})"
    return pb.ModelStreamInferResponse(error_message=message)


def stream_response(response: pb.ModelInferResponse) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(infer_response=response)
