"""V2 requests as OpenAI HTTP requests, and OpenAI answers as V2 responses (pure).

A GPU whose topology entry says ``protocol: openai`` (vLLM, SGLang, TGI, llama.cpp's
server) gets the V2 request the local tier received as an OpenAI request:

* with the request parameter ``openai_body`` (the caller's JSON body, put there by
  the OpenAI edge) that body, as it came, to the route ``openai_route`` names
  (``completions`` or ``chat.completions``), so an OpenAI server gets the chat
  messages themselves, not their template's rendering;
* without it, a ``/v1/completions`` body built from ``text_input`` and
  ``max_tokens`` (what a V2 caller sent).

``stream`` follows the call (ModelInfer: false; ModelStreamInfer: as the request's
``stream`` parameter says), and a streamed request asks for ``usage`` in its last
chunk (``stream_options.include_usage``). Answers become V2 responses: the text as
``text_output``, the server's ``usage`` as the count parameters ``prompt_tokens`` /
``completion_tokens`` (``common.request.tokens``), its ``finish_reason`` as a string
parameter. An HTTP error status becomes the gRPC code of the same meaning
(``grpc_code``). Everything here is a pure function; a malformed answer raises
``BadAnswer``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc

from common.basics.errors import RouteError
from common.config.access import Limits
from common.gen.inference import grpc_service_pb2 as pb
from common.request.openai_v2 import OPENAI_BODY, OPENAI_ROUTE, ROUTE_CHAT, ROUTE_COMPLETIONS
from common.request.tokens import put_counts
from common.request.v2 import parse_generate, text_response

# The seam with the OpenAI edge: its names (common.request.openai_v2).
COMPLETIONS = ROUTE_COMPLETIONS
CHAT_COMPLETIONS = ROUTE_CHAT
PATHS = {COMPLETIONS: "/v1/completions", CHAT_COMPLETIONS: "/v1/chat/completions"}
FINISH_REASON = "finish_reason"
# An inner tier takes the body its parent sent; still bounded (the edge's body limit).
MAX_BODY_CHARS = 4 << 20
# How much of a GPU's error message is quoted in the status detail.
MAX_ERROR_CHARS = 300

_HTTP_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class BadAnswer(ValueError):
    """The GPU's answer is not what the OpenAI API says it is (the message says how)."""


@dataclass(frozen=True)
class OpenAICall:
    """The HTTP request one V2 request becomes."""

    path: str
    body: dict[str, Any]

    @property
    def chat(self) -> bool:
        return self.path == PATHS[CHAT_COMPLETIONS]


def grpc_code(http_status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP error status: 400/413/422 INVALID_ARGUMENT, 404 NOT_FOUND,
    429 RESOURCE_EXHAUSTED, 502/503 UNAVAILABLE (another GPU may serve), 408/504
    DEADLINE_EXCEEDED, 501 UNIMPLEMENTED; any other status (500, a 401 from a server
    that wants a key the tier does not have) is the server's failure: INTERNAL."""
    return _HTTP_CODES.get(http_status, grpc.StatusCode.INTERNAL)


def retry_after_ms(header: str | None) -> int | None:
    """``Retry-After`` in seconds as milliseconds (an HTTP-date, or nonsense: None)."""
    if header is None or not header.strip().isdigit():
        return None
    return min(int(header.strip()), 3600) * 1000


def error_detail(body: bytes) -> str:
    """The message of an OpenAI error body (``{"error": {"message": …}}``, or vLLM's
    older ``{"message": …}``), else the body's start."""
    text = body.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:MAX_ERROR_CHARS].strip()
    if isinstance(doc, dict):
        inner = doc.get("error")
        message = inner.get("message") if isinstance(inner, dict) else doc.get("message")
        if isinstance(message, str):
            return message[:MAX_ERROR_CHARS]
        if isinstance(inner, str):
            return inner[:MAX_ERROR_CHARS]
    return text[:MAX_ERROR_CHARS].strip()


def openai_call(
    request: pb.ModelInferRequest, *, stream: bool, limits: Limits | None = None
) -> OpenAICall:
    """The OpenAI request ``request`` becomes (see the module docstring); RouteError
    (INVALID_ARGUMENT) for a body that is not a JSON object or an unknown route."""
    param = request.parameters.get(OPENAI_BODY)
    if param is None:
        gen = parse_generate(request, limits or Limits())
        body: dict[str, Any] = {
            "model": request.model_name,
            "prompt": gen.prompt,
            "max_tokens": gen.max_tokens,
        }
        return OpenAICall(PATHS[COMPLETIONS], _streamed(body, stream))
    route = _string_param(request, OPENAI_ROUTE) or COMPLETIONS
    if route not in PATHS:
        raise RouteError.invalid(
            f"parameter '{OPENAI_ROUTE}' must be one of {sorted(PATHS)}, got {route[:40]!r}"
        )
    text = _string_param(request, OPENAI_BODY)
    if len(text) > MAX_BODY_CHARS:
        raise RouteError.invalid(f"parameter '{OPENAI_BODY}' is over {MAX_BODY_CHARS} characters")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise RouteError.invalid(f"parameter '{OPENAI_BODY}' is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RouteError.invalid(f"parameter '{OPENAI_BODY}' must be a JSON object")
    n = doc.get("n", 1)
    if n != 1:
        # One V2 response stream carries one answer: more choices would be lost.
        raise RouteError.invalid(f"'n' must be 1 behind Meridian, got {str(n)[:20]}")
    doc["model"] = request.model_name  # where the tiers routed it
    return OpenAICall(PATHS[route], _streamed(doc, stream))


def _string_param(request: pb.ModelInferRequest, name: str) -> str:
    param = request.parameters.get(name)
    if param is None:
        return ""
    if param.WhichOneof("parameter_choice") != "string_param":
        raise RouteError.invalid(f"parameter '{name}' must be a string")
    return str(param.string_param)


def _streamed(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    body["stream"] = stream
    if stream:
        options = body.get("stream_options")
        body["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    else:
        body.pop("stream_options", None)
    return body


def parse_json(raw: bytes | str) -> dict[str, Any]:
    """A JSON object from the GPU; BadAnswer otherwise."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise BadAnswer(f"malformed JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise BadAnswer(f"expected a JSON object, got {type(doc).__name__}")
    return doc


def stream_error(doc: dict[str, Any]) -> tuple[grpc.StatusCode, str] | None:
    """An ``{"error": …}`` event in an SSE stream (vLLM sends one when generation fails
    after the answer began): its code (an HTTP status in ``code``; else INTERNAL) and
    message; None for an ordinary chunk."""
    error = doc.get("error")
    if error is None:
        return None
    status = error.get("code") if isinstance(error, dict) else None
    code = grpc_code(status) if isinstance(status, int) else grpc.StatusCode.INTERNAL
    return code, error_detail(json.dumps(doc).encode())


def _first_choice(doc: dict[str, Any]) -> dict[str, Any] | None:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        raise BadAnswer("no 'choices' list")
    if not choices:
        return None
    choice = choices[0]
    if not isinstance(choice, dict):
        raise BadAnswer("a choice is not an object")
    return choice


def _text_of(choice: dict[str, Any] | None, chat: bool, key: str) -> str:
    if choice is None:
        return ""
    if chat:
        message = choice.get(key)
        if message is None:
            return ""
        if not isinstance(message, dict):
            raise BadAnswer(f"choice '{key}' is not an object")
        text = message.get("content")
    else:
        text = choice.get("text")
    if text is None:
        return ""
    if not isinstance(text, str):
        raise BadAnswer("the choice's text is not a string")
    return text


def usage_of(doc: dict[str, Any]) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from an answer's ``usage`` (None: absent)."""
    usage = doc.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise BadAnswer("'usage' is not an object")
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (_count(prompt) and _count(completion)):
        raise BadAnswer("'usage' lacks non-negative integer token counts")
    return int(prompt), int(completion)  # type: ignore[arg-type]


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def finish_of(choice: dict[str, Any] | None) -> str:
    reason = None if choice is None else choice.get("finish_reason")
    return reason if isinstance(reason, str) else ""


@dataclass(frozen=True)
class Piece:
    """What one answer (or one SSE chunk) carries."""

    text: str
    usage: tuple[int, int] | None
    finish_reason: str


def answer_piece(doc: dict[str, Any], chat: bool) -> Piece:
    """A whole (non-streamed) answer."""
    choice = _first_choice(doc)
    if choice is None:
        raise BadAnswer("'choices' is empty")
    return Piece(_text_of(choice, chat, "message"), usage_of(doc), finish_of(choice))


def chunk_piece(doc: dict[str, Any], chat: bool) -> Piece:
    """One SSE chunk of a streamed answer (the usage chunk has no choices)."""
    choice = _first_choice(doc)
    return Piece(_text_of(choice, chat, "delta"), usage_of(doc), finish_of(choice))


def v2_response(
    request: pb.ModelInferRequest, piece: Piece, *, final: bool | None = None, text: bool = True
) -> pb.ModelInferResponse:
    """``piece`` as a V2 response to ``request``; ``text`` False: a bare final marker
    (no output), as Triton ends a stream."""
    if text:
        response = text_response(request, piece.text, final=final)
    else:
        response = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
        if final is not None:
            response.parameters["triton_final_response"].bool_param = final
    if piece.usage is not None:
        put_counts(response, *piece.usage)
    if piece.finish_reason:
        response.parameters[FINISH_REASON].string_param = piece.finish_reason
    return response
