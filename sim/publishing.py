"""Capacity summaries and periodic work in simulated time.

``SimPublisher`` stands where a tier's ``CapacityPublisher`` and the Redis stream
stand: it builds the tier's summary with the tier's own function on the
topology's cadence, and at once when poked (a utilisation band crossed, a
child's health changed), coalescing pokes within one loop turn as the real
publisher's event does. Instead of XADD and XREAD the summary reaches the
parent's ``ChildSet.take_summary`` after ``propagation_s`` — the delay a
Redis stream and the reader's poll add — so the parent's TTL, replica
bookkeeping and significant-change rules are the servers' own. The newest
summary is also the source of the capacity hint a tier returns on every answer.

``every`` runs a callback on a fixed simulated interval (the tiers' tickers:
refresh, load scrapes, health probes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.capacity.summary import CAPACITY_HINT, encode_hint
from common.gen.meridian.v1 import capacity_pb2

Build = Callable[[int], capacity_pb2.CapacitySummary]
Deliver = Callable[[capacity_pb2.CapacitySummary], None]


class SimPublisher:
    """Publishes ``build(sequence)`` every ``cadence_s`` and on ``poke``; the parent
    receives it ``propagation_s`` later through ``deliver``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        build: Build,
        deliver: Deliver,
        *,
        cadence_s: float,
        propagation_s: float,
    ) -> None:
        self.loop = loop
        self.build = build
        self.deliver = deliver
        self.cadence_s = cadence_s
        self.propagation_s = propagation_s
        self.sequence = 0
        self.published = 0
        self.paused = False  # the tier is down: nothing goes out
        self._hints: dict[str, tuple[tuple[str, str], ...]] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._poked = False

    def start(self) -> None:
        self.publish()

    def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def poke(self) -> None:
        """Publish now rather than at the next tick; pokes in one loop turn coalesce."""
        if not self._poked:
            self._poked = True
            self.loop.call_soon(self.publish)

    def hint_trailers(self, model: str) -> tuple[tuple[str, str], ...]:
        """The capacity hint this tier puts on an answer for ``model`` (may be empty)."""
        return self._hints.get(model, ())

    def hint(self, model: str) -> str | None:
        """The hint's value alone (None: none yet), as a ``Forwarder``'s ``hint_source``."""
        for _, value in self._hints.get(model, ()):
            return value
        return None

    def publish(self) -> None:
        self._poked = False
        if self._tick is not None:
            self._tick.cancel()
        self._tick = self.loop.call_later(self.cadence_s, self.publish)
        if self.paused:
            return
        self.sequence += 1
        self.published += 1
        summary = self.build(self.sequence)
        self._hints = {e.model: ((CAPACITY_HINT, encode_hint(e)),) for e in summary.models}
        if self.propagation_s > 0:
            self.loop.call_later(self.propagation_s, self.deliver, summary)
        else:
            self.deliver(summary)


def every(
    loop: asyncio.AbstractEventLoop, interval_s: float, tick: Callable[[], object]
) -> Callable[[], None]:
    """Call ``tick`` every ``interval_s`` of simulated time; returns the function that
    stops it."""
    handle: list[asyncio.TimerHandle] = []

    def run() -> None:
        tick()
        handle[0] = loop.call_later(interval_s, run)

    handle.append(loop.call_later(interval_s, run))
    return lambda: handle[0].cancel()
