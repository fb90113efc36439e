"""What waits in the central queue: queue keys, the waiter's ticket, FIFO lanes, errors."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


class Abandonable(Protocol):
    """The queue a waiter is in, as the waiter sees it (``local_lb.queue.CentralQueue``)."""

    def _abandon(self, entry: QueuedRequest) -> None: ...


def queue_key(model: str, version: str = "") -> str:
    """What a request waits for: its model, and the version when it asks for one."""
    return f"{model}@{version}" if version else model


def split_key(key: str) -> tuple[str, str]:
    """(model, version) of a ``queue_key``; version "" when any will do."""
    model, _, version = key.partition("@")
    return model, version


class QueueError(Exception):
    """A request left the central queue without a slot."""


class QueueTimeout(QueueError):
    """The request's deadline passed before a GPU freed a slot for it."""


class QueueRejected(QueueError):
    """The request was shed to admit one of higher priority."""


class QueueUnserved(QueueError):
    """No usable GPU serves the request's model any more (all down, ejected or drained)."""


class QueueFull(QueueError):
    """The queue is at ``max_entries`` and holds nothing of lower priority to shed."""


@dataclass(eq=False)
class QueuedRequest:
    """One waiting request; ``enqueue`` returns it as the waiter's ticket.

    ``deadline`` and ``enqueued_at`` are in the queue's clock. Await ``wait()``
    once; cancelling the task that awaits it withdraws the request.
    """

    model: str
    tenant: str
    priority: str
    cost_tokens: float
    deadline: float | None
    enqueued_at: float
    future: asyncio.Future[str] = field(repr=False)
    # Past this it could no longer finish before its client's deadline: never granted.
    start_by: float | None = None
    seq: int = field(default=0, repr=False)
    settled: bool = field(default=False, init=False, repr=False)
    _queue: Abandonable | None = field(default=None, init=False, repr=False)
    _lane: Lane | None = field(default=None, init=False, repr=False)
    _timer: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)
    _grant: str | None = field(default=None, init=False, repr=False)

    async def wait(self) -> str:
        """The name of the GPU whose slot this request now holds.

        Raises QueueTimeout at the deadline, QueueRejected when shed. If the
        task is cancelled after a slot was granted but before it could resume,
        the slot is offered to the next waiter or handed back via ``release``.
        """
        try:
            gpu_name = await self.future
        except asyncio.CancelledError:
            if self._queue is not None:
                self._queue._abandon(self)
            raise
        except QueueError as error:
            # The future keeps ``error``: raised on from here, its traceback would hold
            # this frame, so this entry and its future, a cycle per request turned away
            # that only the cyclic GC frees (and most of them come under overload).
            error.__traceback__ = None
            raise type(error)(*error.args) from None
        self._grant = None
        return gpu_name


class Lane:
    """A FIFO of entries; settled ones leave lazily at either end, or by compaction
    once they outnumber the live ones (so a stuck head cannot pin unbounded garbage)."""

    __slots__ = ("dead", "entries")

    def __init__(self) -> None:
        self.entries: deque[QueuedRequest] = deque()
        self.dead = 0

    def note_dead(self) -> None:
        self.dead += 1
        if self.dead > 16 and 2 * self.dead > len(self.entries):
            self.entries = deque(e for e in self.entries if not e.settled)
            self.dead = 0

    def first(self) -> QueuedRequest | None:
        while self.entries and self.entries[0].settled:
            self.entries.popleft()
            self.dead -= 1
        return self.entries[0] if self.entries else None

    def last(self) -> QueuedRequest | None:
        while self.entries and self.entries[-1].settled:
            self.entries.pop()
            self.dead -= 1
        return self.entries[-1] if self.entries else None
