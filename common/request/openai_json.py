"""OpenAI's JSON, built from what the V2 path answered: completions, chat
completions, their stream chunks, the model list and errors.

An error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the HTTP status matching the gRPC status of the same failure (``HTTP_STATUS``);
``code`` is the gRPC status name in lower case (``resource_exhausted``), ``param``
the body field at fault when one is. A 429 carries ``Retry-After`` (whole
seconds, rounded up) and ``retry-after-ms`` (which the ``openai`` client reads
first) from the refusal's ``retry-after-ms`` trailer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from common.basics.errors import RETRY_AFTER_MS
from common.request.openai_v2 import ROUTE_CHAT, OpenAIRequest
from common.request.routing import trailer

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # nginx's "client closed request": nobody reads it
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class OpenAIError:
    """One error answer: HTTP status, headers and body."""

    status: int
    message: str
    code: str
    param: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPE.get(self.status, "server_error" if self.status >= 500 else "api_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def grpc_error(
    code: grpc.StatusCode,
    message: str,
    trailers: Iterable[tuple[str, str]] = (),
    param: str | None = None,
) -> OpenAIError:
    """The OpenAI error for a gRPC status (the table in the module docstring)."""
    status = HTTP_STATUS.get(code, 500)
    headers: tuple[tuple[str, str], ...] = ()
    wait = trailer(tuple(trailers), RETRY_AFTER_MS)
    if status == 429:
        ms = int(wait) if wait is not None and wait.isdigit() else 1000
        headers = (("Retry-After", str(max(1, -(-ms // 1000)))), (RETRY_AFTER_MS, str(ms)))
    return OpenAIError(status, message, code.name.lower(), param, headers)


@dataclass(frozen=True)
class Usage:
    """What the request cost: the GPU's counts (else the edge's estimates)."""

    prompt_tokens: int
    completion_tokens: int

    def json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def finish_reason(request: OpenAIRequest, usage: Usage) -> str:
    """``length`` when the answer used all of ``max_tokens``, else ``stop``."""
    return "length" if usage.completion_tokens >= request.max_tokens else "stop"


@dataclass(frozen=True)
class Answer:
    """The frame every body of one request shares."""

    request: OpenAIRequest
    id: str
    created: int

    @property
    def chat(self) -> bool:
        return self.request.route == ROUTE_CHAT

    def _frame(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model}

    def whole(self, text: str, usage: Usage) -> dict[str, Any]:
        """The unary answer: one choice and its usage."""
        reason = finish_reason(self.request, usage)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            body = self._frame("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._frame("text_completion")
        return {**body, "choices": [choice], "usage": usage.json()}

    def chunk(self, text: str, reason: str | None = None, *, first: bool = False) -> bytes:
        """One SSE event carrying ``text`` (the first chat chunk also names the role)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": reason,
            }
            body = self._frame("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._frame("text_completion")
        body["choices"] = [choice]
        if self.request.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return sse(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        """The last event when ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._frame(obj), "choices": [], "usage": usage.json()})


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def model_list(models: Iterable[str]) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(m) for m in sorted(models)]}


def model_entry(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "meridian"}
