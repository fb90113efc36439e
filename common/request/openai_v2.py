"""How an OpenAI request travels inside Meridian: as a V2 ModelInferRequest.

The OpenAI edge (``common.request.openai_http``) turns ``POST /v1/completions``
and ``POST /v1/chat/completions`` into a generate-style V2 request that goes down
the tiers unchanged in form, so the tiers, their prefix hashing and V2 GPU
servers see text like any other request:

* BYTES input ``text_input``: the prompt (completions), or the chat template's
  rendering of the messages (``chat_prompt``);
* request parameter ``max_tokens`` (and ``stream`` on ModelStreamInfer) as for V2;
* request parameter ``openai_route``: ``"completions"`` or ``"chat.completions"``;
* request parameter ``openai_body``: the caller's JSON body as it came, without
  ``stream`` / ``stream_options`` and with ``max_tokens`` set to what the edge
  parsed. An OpenAI GPU server gets this body, so it sees the messages as they
  came; a V2 GPU server ignores both ``openai_*`` parameters.

Responses stay V2 (``text_output`` per response or stream chunk, the token count
parameters of ``common.request.tokens``); the edge builds OpenAI JSON from them.

The chat template (documented in the README) is one block per message,
``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n`` for the answer to follow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.basics.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.request.v2 import DEFAULT_MAX_TOKENS, MAX_TOKENS, MAX_TOKENS_LIMIT
from common.request.v2 import generate_request as v2_generate_request

OPENAI_ROUTE = "openai_route"
OPENAI_BODY = "openai_body"
ROUTE_COMPLETIONS = "completions"
ROUTE_CHAT = "chat.completions"
ROUTES = frozenset({ROUTE_COMPLETIONS, ROUTE_CHAT})
# Roles OpenAI's chat API knows; anything else is a typo worth a 400.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Fields the edge answers for itself and does not forward to a GPU server.
EDGE_FIELDS = ("stream", "stream_options")


class BadField(RouteError):
    """INVALID_ARGUMENT about one field of the body; ``param`` names it (OpenAI's
    error ``param``), e.g. ``messages[1].content``."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.param = param


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated OpenAI request, as the edge forwards it."""

    route: str
    model: str
    prompt: str
    max_tokens: int
    stream: bool = False
    # stream_options.include_usage: a last chunk with usage and no choices.
    include_usage: bool = False
    # The body as forwarded (``openai_body``): the caller's, minus EDGE_FIELDS.
    body: dict[str, Any] = field(default_factory=dict)


def chat_prompt(messages: list[tuple[str, str]]) -> str:
    """The chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


def _unicode(text: str, where: str) -> str:
    """``text``, unless it holds a lone surrogate: JSON can escape one (``"\\ud800"``),
    UTF-8 cannot carry it, so the V2 request would fail to encode it (a 500)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(text[exc.start])
            raise BadField(
                where,
                f"'{where}' holds a lone surrogate (\\u{code:04x} at character {exc.start}); "
                "send valid Unicode text",
            ) from None
    return text


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadField(name, f"'{name}' must be an integer, got {type(value).__name__}")
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        raise BadField(name, f"'{name}' must be between 1 and {MAX_TOKENS_LIMIT}, got {value}")
    return value


def _bool_field(body: dict[str, Any], name: str, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadField(where or name, f"'{where or name}' must be true or false, got {value!r}")
    return value


def _completion_prompt(body: dict[str, Any]) -> str:
    """``prompt``: a string, or a list holding one string (one prompt per request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return _unicode(prompt[0], "prompt")
    if isinstance(prompt, str):
        return _unicode(prompt, "prompt")
    if prompt is None:
        raise BadField("prompt", "'prompt' is required: the text to complete")
    if isinstance(prompt, list) and len(prompt) != 1:
        raise BadField(
            "prompt", f"'prompt': one prompt per request is served; got a list of {len(prompt)}"
        )
    raise BadField("prompt", "'prompt' must be a string (token arrays are not served)")


def _content(value: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts joined."""
    if value is None or isinstance(value, str):
        return _unicode(value or "", where)
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadField(f"{where}[{i}]", f"'{where}[{i}]' must be a text part")
            text = part.get("text")
            if not isinstance(text, str):
                raise BadField(f"{where}[{i}].text", f"'{where}[{i}].text' must be a string")
            texts.append(_unicode(text, f"{where}[{i}].text"))
        return "".join(texts)
    raise BadField(where, f"'{where}' must be a string or a list of text parts")


def _chat_messages(body: dict[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise BadField("messages", "'messages' is required: the conversation so far")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "'messages' must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadField(where, f"'{where}' must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            known = ", ".join(sorted(CHAT_ROLES))
            raise BadField(f"{where}.role", f"'{where}.role' must be one of {known}; got {role!r}")
        out.append((str(role), _content(message.get("content"), f"{where}.content")))
    return out


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadField("stream_options", "'stream_options' must be an object")
    return _bool_field(options, "include_usage", "stream_options.include_usage")


def parse_openai(route: str, body: Any) -> OpenAIRequest:
    """Validate a parsed JSON body for ``route``; ``BadField`` (INVALID_ARGUMENT) if
    ill-formed. Fields the edge does not read (temperature, stop, ...) are forwarded."""
    if not isinstance(body, dict):
        raise BadField(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadField("model", "'model' is required: a model name from GET /v1/models")
    _unicode(model, "model")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BadField("n", f"'n' must be 1 (one choice per request is served), got {n!r}")
    if route == ROUTE_CHAT:
        prompt = chat_prompt(_chat_messages(body))
        asked = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens")
    elif route == ROUTE_COMPLETIONS:
        prompt = _completion_prompt(body)
        asked = _int_field(body, "max_tokens")
    else:
        raise BadField(None, f"unknown OpenAI route {route!r}; known: {sorted(ROUTES)}")
    stream = _bool_field(body, "stream")
    include_usage = _include_usage(body)
    max_tokens = asked or DEFAULT_MAX_TOKENS
    forwarded = {k: v for k, v in body.items() if k not in EDGE_FIELDS}
    forwarded["max_tokens"] = max_tokens
    if route == ROUTE_CHAT and "max_completion_tokens" in forwarded:
        forwarded["max_completion_tokens"] = max_tokens
    return OpenAIRequest(route, model, prompt, max_tokens, stream, include_usage, forwarded)


def to_infer_request(request: OpenAIRequest, request_id: str = "") -> pb.ModelInferRequest:
    """The V2 request the tiers carry (see the module docstring). A streamed request
    asks for one response per token (``stream: true``)."""
    infer = v2_generate_request(
        request.model,
        request.prompt,
        request.max_tokens,
        request_id=request_id,
        stream=request.stream,
    )
    infer.parameters[OPENAI_ROUTE].string_param = request.route
    infer.parameters[OPENAI_BODY].string_param = json.dumps(request.body, separators=(",", ":"))
    return infer


def openai_of(request: pb.ModelInferRequest) -> tuple[str, dict[str, Any]] | None:
    """The OpenAI route and body a V2 request carries (for an OpenAI GPU server),
    or None for a plain V2 request. ``max_tokens`` in the body is the request's own
    (the ``max_tokens`` parameter, which the tiers validated); the body has no
    ``stream``: whether to stream is the V2 call's (``common.request.v2.wants_stream``)."""
    route = request.parameters.get(OPENAI_ROUTE)
    raw = request.parameters.get(OPENAI_BODY)
    if route is None or raw is None or route.string_param not in ROUTES:
        return None
    try:
        body = json.loads(raw.string_param)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    param = request.parameters.get(MAX_TOKENS)
    if param is not None and param.WhichOneof("parameter_choice") == "int64_param":
        body["max_tokens"] = int(param.int64_param)
    return route.string_param, body
