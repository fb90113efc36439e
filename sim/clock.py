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
import contextvars
import gc
import heapq
import math
import selectors
from asyncio import base_events, format_helpers
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar, cast

T = TypeVar("T")

_NOTHING_SCHEDULED = (
    "the simulated loop has nothing scheduled and nothing ready: "
    "a coroutine waits for something that can never happen"
)
# BaseEventLoop's own constants (asyncio.base_events), for the same heap clean-ups.
_BASE: Any = base_events  # its private parts are not in the type stubs
_MIN_SCHEDULED: int = _BASE._MIN_SCHEDULED_TIMER_HANDLES
_MIN_CANCELLED: float = _BASE._MIN_CANCELLED_TIMER_HANDLES_FRACTION
_MAX_TIMEOUT: float = _BASE.MAXIMUM_SELECT_TIMEOUT
_NAN = math.nan
_TIMER_NEW = asyncio.TimerHandle.__new__
_HANDLE_NEW = asyncio.Handle.__new__

# Young-generation threshold of the cyclic GC during a run: 0, no automatic collection.
# A run keeps large long-lived structures (prefix indexes, caches, the fleet) and its
# requests in flight (~30 objects each; ~17 000 in flight on 1024 GPUs at 90 % load for
# Meridian, over 100 000 for a policy that overloads its regions), and its request path
# makes no reference cycles (tests/sim's ``request_leftovers`` checks the failover
# paths): collecting only scanned live requests. At the default threshold (700) the
# collector took a quarter of a run; at 1 000 000 an overloaded run of 300 000 requests
# (nginx_least_conn, steady 90 %) still spent 19 s of 225 in it, ~2 s a collection (a
# run without it: 211 s, the same peak memory). What a run does leave for the collector
# is freed once it is over.
RUN_GC_THRESHOLD = 0


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
            raise RuntimeError(_NOTHING_SCHEDULED)
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

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        """``BaseEventLoop.call_at``, the timer kept in the heap as ``(when, NaN, timer)``.

        Compared as the timers themselves compare (``TimerHandle.__lt__`` is ``when <
        when``; a fresh NaN is equal to nothing, and less than nothing, so ties stay
        unordered), hence the same heap, but in C instead of a Python ``__lt__`` per
        comparison: a run pushes and pops millions of timers."""
        if when is None:
            raise TypeError("when cannot be None")
        loop: Any = self  # BaseEventLoop's private state is not in the type stubs
        loop._check_closed()
        timer: Any
        if loop._debug:
            loop._check_thread()
            loop._check_callback(callback, "call_at")
            timer = asyncio.TimerHandle(when, callback, args, self, context)
            if timer._source_traceback:
                del timer._source_traceback[-1]
        else:  # what TimerHandle(...) sets outside debug mode, without its two __init__s
            timer = _TIMER_NEW(asyncio.TimerHandle)
            timer._context = contextvars.copy_context() if context is None else context
            timer._loop, timer._callback, timer._args = self, callback, args
            timer._cancelled, timer._repr, timer._source_traceback = False, None, None
            timer._when = when
        heapq.heappush(loop._scheduled, (timer._when, -_NAN, timer))
        timer._scheduled = True
        return cast(asyncio.TimerHandle, timer)

    def call_soon(  # type: ignore[override]
        self,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        """``BaseEventLoop.call_soon``, the handle built in place outside debug mode (as
        ``call_at``): every future a request awaits wakes it through here."""
        loop: Any = self
        if loop._debug:
            return super().call_soon(callback, *args, context=context)
        if loop._closed:
            raise RuntimeError("Event loop is closed")
        handle: Any = _HANDLE_NEW(asyncio.Handle)
        handle._context = contextvars.copy_context() if context is None else context
        handle._loop, handle._callback, handle._args = self, callback, args
        handle._cancelled, handle._repr, handle._source_traceback = False, None, None
        loop._ready.append(handle)
        return cast(asyncio.Handle, handle)

    def _run_once(self) -> None:
        """``BaseEventLoop._run_once`` (CPython 3.11) over ``call_at``'s heap, without the
        selector round trip, the I/O event processing and the debug checks, none of
        which a simulated loop needs: the same clean-ups, the same clock jumps (``now +
        (when - now)``, as ``select(timeout)`` did) and the same handles in the same
        order. A simulated run is millions of iterations, a few per request."""
        loop: Any = self
        scheduled = loop._scheduled
        count = len(scheduled)
        if count > _MIN_SCHEDULED and loop._timer_cancelled_count / count > _MIN_CANCELLED:
            kept = []
            for entry in scheduled:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            loop._scheduled = scheduled = kept
            loop._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0][2]._cancelled:
                loop._timer_cancelled_count -= 1
                heapq.heappop(scheduled)[2]._scheduled = False
        ready = loop._ready
        if not ready and not loop._stopping:
            if not scheduled:
                raise RuntimeError(_NOTHING_SCHEDULED)
            timeout = min(max(0, scheduled[0][0] - self._now), _MAX_TIMEOUT)
            if timeout > 0:
                self._now += timeout
        end_time = self._now + self._clock_resolution
        while scheduled and scheduled[0][0] < end_time:
            handle = heapq.heappop(scheduled)[2]
            handle._scheduled = False
            ready.append(handle)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if handle._cancelled:
                continue
            try:  # Handle._run, in line
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                _report(handle, exc)


def _report(handle: Any, exc: BaseException) -> None:
    """What ``Handle._run`` does with a callback's exception: the loop's handler."""
    source = format_helpers._format_callback_source(handle._callback, handle._args)
    context = {"message": f"Exception in callback {source}", "exception": exc, "handle": handle}
    if handle._source_traceback:
        context["source_traceback"] = handle._source_traceback
    handle._loop.call_exception_handler(context)


@contextlib.contextmanager
def _run_gc() -> Iterator[None]:
    """No automatic cyclic GC during a run (``RUN_GC_THRESHOLD``): what exists before
    it (modules, the topology) is frozen out of every collection, and the young
    generation is never collected. Nothing the simulation computes depends on when
    the collector runs."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(RUN_GC_THRESHOLD, thresholds[1], thresholds[2])
    try:
        yield
    finally:
        # What the run left joins the oldest generation (freezing it first resets the
        # young count), where the next full collection frees whatever the run left
        # for the collector, rather than a young collection scanning it all at once.
        gc.freeze()
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
