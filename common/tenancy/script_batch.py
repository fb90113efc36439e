"""Quota scripts asked for in one event-loop turn go to Redis together: one write, one read.

Under load the edge admits many requests at once. Sent one by one, each quota
script takes a pooled connection of its own and costs a write and a read on
both sides, which is most of what a quota call costs the edge and Redis. A
``ScriptBatch`` queues the calls made while the loop runs one turn and, when the
turn ends, sends them as one pipeline. It is not a transaction: each script is
atomic on its own, and one script's error is only its caller's. A call alone
goes out as a plain EVALSHA. Calls Redis answers NOSCRIPT (it restarted, or its
scripts were flushed) are sent once more as EVAL.

One batch is on its way at a time; calls made meanwhile wait for it and go in
the next. So scripts run in Redis in the order they were asked for: a lease's
release (``common.tenancy.concurrency``) never overtakes its acquire, as it
could on two pooled connections.

A batch's connection error or timeout is every call's in it (they shared the
connection); the caller (``QuotaRedis``) decides what it means. A caller that
stops waiting (cancelled, timed out) leaves its script to run: whatever it does
must be safe to have happened, as it always was when a reply was lost.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError


@dataclass(frozen=True)
class Script:
    """A Lua script, sent by its SHA-1 (EVALSHA) and as text only when Redis lacks it."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


@dataclass(slots=True)
class _Call:
    script: Script
    keys: Sequence[str]
    args: Sequence[str]
    reply: asyncio.Future[Any]


class ScriptBatch:
    """Runs scripts on ``client``: those asked for in one loop turn, or while the batch
    before was on its way, in one pipeline; one batch at a time, in order."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        self._queued: list[_Call] = []
        self._flush_due = False
        self._sending: asyncio.Task[None] | None = None
        # Batches sent, and calls in them (for tests and the curious).
        self.batches = 0
        self.calls = 0

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        """The script's reply, or the error Redis or the connection gave."""
        loop = asyncio.get_running_loop()
        call = _Call(script, keys, args, loop.create_future())
        self._queued.append(call)
        self._flush_soon(loop)
        return await call.reply

    async def drain(self) -> None:
        """Wait until every script asked for has been sent and answered (before the
        client closes)."""
        while self._sending is not None or self._queued:
            if self._sending is not None:
                await asyncio.wait([self._sending])
            else:
                await asyncio.sleep(0)

    def _flush_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send what is queued at the end of this turn (after every callback in it),
        unless a batch is on its way: then when it is back."""
        if not self._flush_due and self._sending is None:
            self._flush_due = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._sending is not None or not self._queued:
            return
        calls, self._queued = self._queued, []
        self._sending = asyncio.get_running_loop().create_task(self._send(calls))

    async def _send(self, calls: list[_Call]) -> None:
        self.batches += 1
        self.calls += len(calls)
        try:
            if len(calls) == 1:
                _settle(calls[0], await self._one(calls[0]))
                return
            replies = await self._pipeline(calls, by_sha=True)
            again = [c for c, r in zip(calls, replies, strict=True) if isinstance(r, NoScriptError)]
            for call, reply in zip(calls, replies, strict=True):
                if not isinstance(reply, NoScriptError):
                    _settle(call, reply)
            if again:
                replies = await self._pipeline(again, by_sha=False)
                for call, reply in zip(again, replies, strict=True):
                    _settle(call, reply)
        except Exception as exc:  # the connection or a timeout: every call's
            for call in calls:
                if not call.reply.done():
                    call.reply.set_exception(exc)
        finally:
            self._sending = None
            if self._queued:
                self._flush_soon(asyncio.get_running_loop())

    async def _one(self, call: _Call) -> Any:
        n = len(call.keys)
        try:
            return await self.client.evalsha(call.script.sha, n, *call.keys, *call.args)
        except NoScriptError:
            return await self.client.eval(call.script.text, n, *call.keys, *call.args)

    async def _pipeline(self, calls: list[_Call], *, by_sha: bool) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            n = len(call.keys)
            if by_sha:
                pipe.evalsha(call.script.sha, n, *call.keys, *call.args)
            else:
                pipe.eval(call.script.text, n, *call.keys, *call.args)
        return await pipe.execute(raise_on_error=False)


def _settle(call: _Call, reply: Any) -> None:
    if call.reply.done():  # its caller stopped waiting
        return
    if isinstance(reply, Exception):
        call.reply.set_exception(reply)
    else:
        call.reply.set_result(reply)
