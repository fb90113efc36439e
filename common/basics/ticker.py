"""Ticker: a callback on a fixed interval, as a start/stop service of a tier."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from common.basics.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class Ticker:
    """Calls ``tick()`` every ``interval_s`` until stopped; a failing tick is logged."""

    def __init__(self, tick: Callable[[], object], interval_s: float) -> None:
        self.tick = tick
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ticker")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:
                log.exception("periodic %s failed", getattr(self.tick, "__name__", "tick"))
