"""The open-loop OpenAI HTTP client: every turn of a schedule sent at its time, to one front.

Each request is its own task, started at its arrival offset whatever the state of the
others (open loop: a slow front faces the same arrivals, and its queue grows). Chat or
text completions (``api``), ``stream`` as the turn says (with ``stream_options.include_usage``, so a
stream's token count is the server's), at most ``timeout_s`` each. The SSE reader looks
at each event only as much as it must: the first event with content starts TTFT, the
usage event gives the tokens, ``[DONE]`` ends it; an ``error`` event is a failure.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from bench.field_routers.stats import Outcome
from bench.field_routers.workload import Turn, salted

MODEL = "demo-llm"
# The OpenAI routes, by ``api``: chat or (text) completions.
PATHS = {"chat": "chat/completions", "completions": "completions"}


@dataclass(frozen=True)
class Front:
    """Where one front takes OpenAI HTTP, and as whom."""

    name: str
    base_url: str  # ".../v1"
    headers: tuple[tuple[str, str], ...] = ()


def body(turn: Turn, salt: str, api: str) -> dict[str, object]:
    """The request's JSON: a chat's messages, or (``api`` "completions") the same
    conversation as one prompt of ``role: content`` lines, as the emulated GPU renders a
    chat (so the prompt's tokens are the same either way)."""
    messages = salted(turn, salt)
    doc: dict[str, object] = {"model": MODEL, "max_tokens": turn.max_tokens, "stream": turn.stream}
    if api == "chat":
        doc["messages"] = messages
    else:
        doc["prompt"] = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    if turn.stream:
        doc["stream_options"] = {"include_usage": True}
    return doc


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome, t0: float) -> None:
    done = False
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            out.error = "stream_error"
            return
        choices = event.get("choices") or ()
        if choices:
            choice = choices[0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - t0
                out.chunks += 1
        usage = event.get("usage")
        if usage:
            out.tokens = int(usage.get("completion_tokens") or 0)
    if not done:
        out.error = "stream_cut"
        return
    out.tokens = out.tokens or out.chunks
    out.ok = True


async def send(
    http: aiohttp.ClientSession, front: Front, turn: Turn, salt: str, timeout_s: float, api: str
) -> Outcome:
    """One request to ``front``; its outcome (never raises for the request's own failure)."""
    out = Outcome(stream=turn.stream, asked_tokens=turn.max_tokens)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(
                f"{front.base_url}/{PATHS[api]}",
                json=body(turn, salt, api),
                headers=dict(front.headers),
            ) as resp:
                if resp.status != 200:
                    await resp.read()
                    out.error = f"http_{resp.status}"
                    return out
                if turn.stream:
                    await _read_stream(resp, out, t0)
                else:
                    doc = await resp.json()
                    out.ttft_s = time.perf_counter() - t0
                    out.tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
                    out.ok = True
    except TimeoutError:
        out.error, out.ok = "timeout", False
    except (aiohttp.ClientError, ValueError) as exc:
        out.error, out.ok = type(exc).__name__, False
    if out.ok and out.tokens < turn.max_tokens:
        out.error, out.ok = "short", False  # the emulated GPU always generates max_tokens
    out.e2e_s = time.perf_counter() - t0
    return out


async def offer(
    front: Front, turns: Sequence[Turn], salt: str, timeout_s: float, api: str
) -> list[Outcome]:
    """Send every turn at its offset from now; the outcomes, in the turns' order."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = time.perf_counter()

        async def at(turn: Turn) -> Outcome:
            delay = start + turn.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await send(http, front, turn, salt, timeout_s, api)

        return list(await asyncio.gather(*(at(t) for t in turns)))
