"""The emulated GPU's OpenAI HTTP side: vLLM's API around the same ``GpuEngine``.

A GPU whose entry says ``protocol: openai`` (or a worker run with ``--protocol
openai``) serves, on its ``listen`` address, what a vLLM server serves:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, unary or with
  ``stream: true`` as server-sent events (``data: {…}`` chunks, one per token,
  the last with ``finish_reason``; with ``stream_options.include_usage`` a last
  chunk with no choices and the ``usage``; then ``data: [DONE]``);
* ``GET /v1/models`` (the models it serves), ``GET /health`` (200 while serving,
  503 while starting or stopping) and ``GET /metrics`` (vLLM's names,
  ``sim.vllm_metrics``) on the same port.

Errors are OpenAI's JSON shape with vLLM's statuses: 400 for a bad body or a
prompt the KV cache cannot hold, 404 for a model it does not serve, 503 when the
engine is not running. A chat's messages become the prompt as ``role: content``
lines (the emulated tokenizer counts whitespace words, so any rendering would do).
A client that disconnects cancels its handler, and so its generation.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from common.config.gpu import GpuConfig
from common.request.v2 import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT
from sim.engine import EngineError, GpuEngine, RequestTooLarge
from sim.vllm_metrics import PROMETHEUS_CONTENT_TYPE, metrics_text


class BadRequest(Exception):
    """The body is not a request this API takes; ``status`` and message for the caller."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def error_body(status: int, message: str, kind: str) -> web.Response:
    """OpenAI's error shape."""
    doc = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(doc, status=status)


@dataclass(frozen=True)
class Completion:
    """One parsed request: where it goes, what it asks."""

    model: str
    prompt: str
    max_tokens: int
    stream: bool
    include_usage: bool
    chat: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.split())


def parse_completion(doc: Any, chat: bool) -> Completion:
    """The request a body asks for; BadRequest (400) naming the bad field."""
    if not isinstance(doc, dict):
        raise BadRequest(400, "the body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "'model' must be a non-empty string")
    prompt = _messages_prompt(doc.get("messages")) if chat else _prompt(doc.get("prompt"))
    # A chat request may name its cap max_completion_tokens (OpenAI's newer name, which
    # vLLM reads first and SMG and sglang-router forward); a completion max_tokens.
    field = "max_completion_tokens" if chat and "max_completion_tokens" in doc else "max_tokens"
    max_tokens = doc.get(field, DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise BadRequest(400, f"'{field}' must be an integer")
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadRequest(400, f"'{field}' must be between 1 and {MAX_TOKENS_LIMIT}")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be a boolean")
    options = doc.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest(400, "'stream_options' must be an object")
    usage = bool(options.get("include_usage", False))
    return Completion(model, prompt, max_tokens, stream, usage, chat)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise BadRequest(400, "'prompt' must be a string (or a list of one)")
    return value


def _messages_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list")
    lines = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise BadRequest(400, "each message must be an object with a string 'content'")
        lines.append(f"{message.get('role', 'user')}: {message['content']}")
    return "\n".join(lines)


class OpenAIServer:
    """vLLM's OpenAI API for one emulated GPU (see the module docstring)."""

    def __init__(self, gpu: GpuConfig, engine: GpuEngine, ready: Callable[[], bool]) -> None:
        self.gpu = gpu
        self.engine = engine
        self.ready = ready
        self.port = gpu.endpoint.port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        # A client that goes away cancels its handler: its generation stops, its slot frees.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.gpu.endpoint.host, self.gpu.endpoint.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self, grace: float) -> None:
        """Stop accepting, give requests in flight ``grace`` s, then close every connection."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            # aiohttp reads a timeout of 0 as "none": wait for every handler to finish.
            await runner.server.shutdown(max(grace, 0.001))
        await runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        if self.ready():
            return web.Response(text="")
        return error_body(503, f"GPU {self.gpu.name} is not serving", "ServiceUnavailableError")

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        cards = [
            {"id": m, "object": "model", "created": created, "owned_by": "meridian-sim"}
            for m in self.gpu.models
        ]
        return web.json_response({"object": "list", "data": cards})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = metrics_text(self.gpu, self.engine)
        return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            try:
                doc = await request.json()
            except ValueError:
                raise BadRequest(400, "the body is not JSON") from None
            ask = parse_completion(doc, chat)
            if ask.model not in self.gpu.models:
                message = (
                    f"The model `{ask.model}` does not exist (it serves {list(self.gpu.models)})"
                )
                raise BadRequest(404, message, "NotFoundError")
            if not self.ready():
                raise BadRequest(
                    503, f"GPU {self.gpu.name} is not serving", "ServiceUnavailableError"
                )
            if ask.stream:
                return await self._stream(request, ask)
            words = [w async for w in self._tokens(ask)]
        except BadRequest as exc:
            return error_body(exc.status, str(exc), exc.kind)
        doc = _envelope(ask, chunk=False)
        text = " ".join(words)
        doc["choices"] = [_choice(ask, text, "length", chunk=False)]
        doc["usage"] = _usage(ask, len(words))
        return web.json_response(doc)

    async def _tokens(self, ask: Completion) -> AsyncGenerator[str, None]:
        """The engine's tokens; an engine failure before the first is a BadRequest."""
        try:
            async with contextlib.aclosing(
                self.engine.generate(ask.prompt, ask.max_tokens, model=ask.model)
            ) as tokens:
                async for token in tokens:
                    yield token
        except RequestTooLarge as exc:
            raise BadRequest(400, str(exc)) from None
        except EngineError as exc:
            raise BadRequest(503, str(exc), "ServiceUnavailableError") from None

    async def _stream(self, request: web.Request, ask: Completion) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        envelope = _envelope(ask, chunk=True)
        generated = 0
        async with contextlib.aclosing(self._tokens(ask)) as tokens:
            try:
                async for token in tokens:
                    if not generated:
                        await response.prepare(request)
                    last = generated + 1 == ask.max_tokens
                    piece = token if not generated else " " + token
                    generated += 1
                    choice = _choice(ask, piece, "length" if last else None, chunk=True)
                    await _send(response, {**envelope, "choices": [choice]})
            except BadRequest as exc:
                if not generated:  # nothing sent yet: an ordinary error answer
                    return error_body(exc.status, str(exc), exc.kind)
                error = {"message": str(exc), "type": exc.kind, "code": exc.status}
                await _send(response, {"error": error})
                return response  # no [DONE]: the stream did not finish
        if ask.include_usage:
            await _send(response, {**envelope, "choices": [], "usage": _usage(ask, generated)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _envelope(ask: Completion, *, chunk: bool) -> dict[str, Any]:
    kind = "chat.completion" if ask.chat else "text_completion"
    return {
        "id": f"{'chatcmpl' if ask.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": f"{kind}.chunk" if chunk and ask.chat else kind,
        "created": int(time.time()),
        "model": ask.model,
    }


def _choice(ask: Completion, text: str, finish: str | None, *, chunk: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if not ask.chat:
        choice.update(text=text, logprobs=None)
    elif chunk:
        choice["delta"] = {"content": text}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    return choice


def _usage(ask: Completion, generated: int) -> dict[str, int]:
    prompt = ask.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def gpu_probe(gpu: GpuConfig) -> str:
    """Where a launcher asks whether an emulated GPU serves: a V2 GPU's address (it asks
    ServerReady), an OpenAI GPU's ``/health`` URL."""
    if gpu.protocol == "openai":
        return f"http://{gpu.endpoint.address}/health"
    return gpu.endpoint.address


def openai_ready(url: str, timeout_s: float) -> bool:
    """True when ``url`` (an OpenAI server's ``/health``) answers 200 (blocking: for the
    launcher, outside any event loop)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


async def _send(response: web.StreamResponse, doc: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
