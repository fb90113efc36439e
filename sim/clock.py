"""An asyncio event loop that runs in simulated time.

The fleet simulator drives the servers' own decision code — balancers whose
central queue awaits futures and arms ``loop.call_at`` timers — so instead of
copying that code into a callback world it runs it on a loop whose clock is
virtual: when nothing is ready, the loop jumps straight to the next timer
rather than sleeping until it is due. Every ``clock`` a component takes is
``loop.time``, so a balancer, its queue and the GPU model all see one timeline.
No file descriptor is ever waited on: the selector below only satisfies the
loop's own self-pipe and refuses to block.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

# Young-generation threshold of the cyclic GC during a run (CPython's default: 700).
# A run allocates a few objects per event and keeps large long-lived structures
# (prefix indexes, caches, the fleet); at the default threshold the collector ran
# ~70 times per 1000 requests and took a quarter of the run.
RUN_GC_THRESHOLD = 50_000


class _JumpingSelector(selectors.BaseSelector):
    """A selector that never waits: ``select(timeout)`` moves the loop's clock on."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.loop: SimulatedLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError(
                "the simulated loop has nothing scheduled and nothing ready: "
                "a coroutine waits for something that can never happen"
            )
        assert self.loop is not None
        if timeout > 0:
            self.loop.advance(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class SimulatedLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is simulated seconds, starting at ``start``."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _JumpingSelector()
        self._now = start
        super().__init__(selector)
        selector.loop = self
        # Timers due within this much are run together: events at the same simulated
        # instant must not be split by float rounding.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


@contextlib.contextmanager
def _run_gc() -> Iterator[None]:
    """Cyclic GC for a long run: what exists before it (modules, the topology) is
    frozen out of every collection, and young objects are collected in large
    batches, so most of a request's objects die before they are ever scanned.
    Nothing the simulation computes depends on when the collector runs."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(RUN_GC_THRESHOLD, thresholds[1], thresholds[2])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def run_simulated(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh ``SimulatedLoop``; return its result."""
    loop = SimulatedLoop(start)
    try:
        with _run_gc():
            return loop.run_until_complete(main)
    finally:
        loop.close()
