"""Publication: when the zone's utilisation crosses a band, tell the capacity publisher."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.capacity.summary import utilisation_band


def _nothing() -> None:
    return None


@dataclass
class LateBoundCallback:
    """A zero-argument callback whose target is connected once, after both ends exist.

    The balancer must be told where to send "utilisation crossed a band" when it is
    built, but the capacity publisher it sends to reads the balancer's queue, so one
    of the two is built first. This object is that first thing: the balancer holds it
    from construction, and ``connect`` names the target exactly once.

    Failure mode: a call before ``connect`` does nothing (the summary goes out at the
    publisher's next cadence tick instead); a second ``connect`` raises, so a wiring
    mistake cannot silently redirect it. Caches nothing.
    """

    _target: Callable[[], None] = field(default_factory=lambda: _nothing, init=False)
    _connected: bool = field(default=False, init=False)

    def connect(self, target: Callable[[], None]) -> None:
        if self._connected:
            raise RuntimeError("LateBoundCallback is already connected")
        self._target, self._connected = target, True

    def __call__(self) -> None:
        self._target()


@dataclass
class UtilisationBands:
    """Calls ``on_crossing`` when the zone's utilisation moves into another band.

    Algorithm: utilisation is in-flight requests over all slots (``utilisation_band``
    quantises it); a summary is pushed up at once only when the band changes, so the
    regional tier hears of a zone filling up without a message per request.

    Caches the last band seen (starts at 0, idle), so ``observe`` is O(1).
    Failure mode: the callback runs synchronously on the request path; it must only
    schedule work (``CapacityPublisher.poke`` does), never block.
    """

    on_crossing: Callable[[], None] = _nothing
    band: int = 0

    def observe(self, inflight: int, total_slots: int) -> None:
        band = utilisation_band(inflight / max(1, total_slots))
        if band != self.band:
            self.band = band
            self.on_crossing()
