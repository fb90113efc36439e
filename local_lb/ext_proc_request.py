"""What the endpoint picker reads of a request Envoy holds: its route, hints and model.

Envoy's ext_proc filter sends the request headers, then (``request_body_mode:
BUFFERED``) the whole body in one message. The picker supports two kinds of
request, told apart by their headers:

* **KServe V2 over gRPC**, ``/inference.GRPCInferenceService/ModelInfer``: the
  body is one gRPC message frame (1-byte compressed flag, 4-byte big-endian
  length) holding a ``ModelInferRequest``, read by the same ``parse_generate``
  every tier uses. ``ModelStreamInfer`` is refused (UNIMPLEMENTED): Envoy must
  hold the body until it ends to read the model, and a stream's body ends only
  when its caller closes it. Other V2 methods are UNIMPLEMENTED too.
* **OpenAI JSON**, ``POST /v1/completions`` and ``POST /v1/chat/completions``,
  read by the OpenAI edge's own ``parse_openai``: ``model``, the prompt (or the
  chat template's rendering of ``messages``), which the picker estimates and
  hashes for prefix affinity, and ``max_tokens`` (or ``max_completion_tokens``).

Everything here is pure: a bad request raises ``RouteError`` with the status
the caller gets (INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from common.basics.errors import RouteError
from common.config.access import Limits
from common.gen.inference import grpc_service_pb2 as pb
from common.request.openai_v2 import ROUTE_CHAT, ROUTE_COMPLETIONS, BadField, parse_openai
from common.request.routing import MERIDIAN_PREFIX, TRACE_KEYS, RouteHints, parse_hints
from common.request.v2 import MAX_NAME_CHARS, GenerateRequest, parse_generate

V2_SERVICE_PATH = "/inference.GRPCInferenceService/"
V2_INFER_PATH = V2_SERVICE_PATH + "ModelInfer"
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
GRPC_FRAME_HEADER = 5
# grpc-timeout units (gRPC over HTTP/2) in seconds.
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def unimplemented(message: str) -> RouteError:
    return RouteError(grpc.StatusCode.UNIMPLEMENTED, message)


@dataclass(frozen=True)
class RequestHead:
    """The request line and the headers the picker reads."""

    method: str
    path: str
    grpc: bool
    hints: RouteHints
    # The caller's grpc-timeout, if it sent one.
    timeout_s: float | None = None


def header_pairs(headers: Sequence[Any]) -> list[tuple[str, str]]:
    """Envoy's ``HeaderValue`` list as text pairs (raw bytes read as Latin-1, so any
    byte that is not printable ASCII stays visible to the hint checks)."""
    return [(h.key, h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in headers]


def is_grpc(headers: Sequence[tuple[str, str]]) -> bool:
    """A gRPC call (its refusals then carry a gRPC status)."""
    return any(k == "content-type" and v.startswith("application/grpc") for k, v in headers)


def read_head(headers: Sequence[tuple[str, str]]) -> RequestHead:
    """The route and routing hints (``x-meridian-*``, read as at the edge: an unknown
    ``x-meridian-*`` key or a malformed value is INVALID_ARGUMENT naming it)."""
    values = dict(headers)
    path = values.get(":path", "").split("?", 1)[0]
    grpc_call = is_grpc(headers)
    meridian = [(k, v) for k, v in headers if k.startswith(MERIDIAN_PREFIX) or k in TRACE_KEYS]
    hints = parse_hints(meridian, trust_internal=False)
    timeout = _grpc_timeout(values.get("grpc-timeout")) if grpc_call else None
    head = RequestHead(values.get(":method", ""), path, grpc_call, hints, timeout)
    _check_route(head)
    return head


def _grpc_timeout(text: str | None) -> float | None:
    if not text:
        return None
    amount, unit = text[:-1], text[-1:]
    if not amount.isdigit() or len(amount) > 8 or unit not in _TIMEOUT_UNITS:
        raise RouteError.invalid(f"grpc-timeout {text[:32]!r} is not a gRPC timeout")
    return int(amount) * _TIMEOUT_UNITS[unit]


def _check_route(head: RequestHead) -> None:
    if head.grpc:
        if head.path == V2_INFER_PATH:
            return
        if head.path.startswith(V2_SERVICE_PATH):
            raise unimplemented(
                f"{head.path.rsplit('/', 1)[-1]} is not served through the endpoint picker "
                "(it reads the model from a whole request body: call ModelInfer, or the "
                "local tier itself for streams and metadata)"
            )
        raise unimplemented(f"gRPC method {head.path[:128]!r} is not KServe V2 ModelInfer")
    if head.path not in OPENAI_PATHS:
        raise RouteError.not_found(
            f"no route {head.path[:128]!r}; the endpoint picker serves POST "
            f"{' and '.join(sorted(OPENAI_PATHS))} and V2 ModelInfer over gRPC"
        )
    if head.method != "POST":
        raise RouteError.invalid(f"{head.path} takes POST, not {head.method[:16]!r}")


def read_body(head: RequestHead, body: bytes, limits: Limits) -> GenerateRequest:
    """The model, prompt and length the pick needs, from the whole request body."""
    if len(body) > limits.max_message_bytes:
        raise RouteError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request body of {len(body)} bytes is over limits.max_message_bytes "
            f"({limits.max_message_bytes}); make it smaller",
        )
    return read_v2(body, limits) if head.grpc else read_openai(head.path, body, limits)


def read_v2(body: bytes, limits: Limits) -> GenerateRequest:
    """One uncompressed gRPC message frame holding a ``ModelInferRequest``."""
    if len(body) < GRPC_FRAME_HEADER:
        raise RouteError.invalid("the gRPC request body holds no message frame")
    if body[0] != 0:
        raise RouteError.invalid(
            "compressed gRPC messages are not read by the endpoint picker; send them uncompressed"
        )
    length = int.from_bytes(body[1:GRPC_FRAME_HEADER], "big")
    if len(body) != GRPC_FRAME_HEADER + length:
        raise RouteError.invalid(
            "the gRPC request body must hold exactly one message frame "
            f"({len(body)} bytes, frame of {length})"
        )
    try:
        request = pb.ModelInferRequest.FromString(body[GRPC_FRAME_HEADER:])
    except DecodeError:
        raise RouteError.invalid("the gRPC message is not a ModelInferRequest") from None
    return parse_generate(request, limits)


def read_openai(path: str, body: bytes, limits: Limits) -> GenerateRequest:
    """An OpenAI completions or chat completions body, validated as the OpenAI edge does
    (``common.request.openai_v2``: same 400s, same chat template, so a chat request's
    prefix blocks are hashed as the edge's would be)."""
    try:
        doc = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadField(None, f"the request body is not valid JSON: {exc}") from None
    route = ROUTE_CHAT if path.endswith("/chat/completions") else ROUTE_COMPLETIONS
    request = parse_openai(route, doc)
    if len(request.model) > MAX_NAME_CHARS:
        raise BadField("model", f"'model' is longer than {MAX_NAME_CHARS} characters")
    if len(request.prompt.encode()) > limits.max_prompt_bytes:
        raise BadField(
            None, f"the prompt is over limits.max_prompt_bytes ({limits.max_prompt_bytes} bytes)"
        )
    return GenerateRequest(request.model, "", request.prompt, request.max_tokens)
