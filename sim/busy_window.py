"""Utilisation while the load lasts: each GPU's busy share between two instants.

The run's utilisation (``busy_s / duration_s``) also counts the fleet's empty start
and the drain after the last arrival; at 1024 GPUs a run's 40 s of arrivals is
followed by several seconds of drain, so that figure cannot say whether a saturated
fleet kept its GPUs busy. ``BusyWindow`` reads every GPU's busy time when the
warm-up ends and at the last arrival (``sim.run`` schedules both on the simulated
clock; a step under way is counted up to the instant) and gives each GPU's share of
that window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class BusyClock(Protocol):
    def busy_until(self, now: float) -> float:
        """Seconds spent stepping from the start of the run up to ``now``."""
        ...


@dataclass
class BusyWindow:
    """Busy shares of ``gpus`` from ``start_s`` to ``end_s`` (see the module docstring)."""

    gpus: Sequence[BusyClock]
    start_s: float
    end_s: float
    _at_start: list[float] = field(default_factory=list, init=False)
    shares: list[float] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_s < self.end_s:
            raise ValueError(
                f"BusyWindow needs 0 <= start_s < end_s, got {self.start_s!r}, {self.end_s!r}"
            )

    def begin(self) -> None:
        self._at_start = [g.busy_until(self.start_s) for g in self.gpus]

    def end(self) -> None:
        span = self.end_s - self.start_s
        start = self._at_start or [0.0] * len(self.gpus)
        self.shares = [
            (g.busy_until(self.end_s) - before) / span
            for g, before in zip(self.gpus, start, strict=True)
        ]
