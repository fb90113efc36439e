"""Exponential back-off, written once.

One formula, ``exponential_s``: the window before try ``n`` (1 is the first
retry) is ``base_s * 2 ** (n - 1)``, capped at ``max_s``. Three shapes use it:

- ``backoff_delay_s``: Envoy's fully-jittered delay before a retried request
  (uniform in ``[0, window)``), with an injected ``rng``.
- ``Backoff``: counts consecutive failures and gives the next window, for callers
  that keep their own clock (the quota limiter re-tries Redis at ``now + delay``).
- ``Reconnect``: a ``Backoff`` for reconnect loops that sleeps, logging an outage
  once when it starts and once when it ends (Redis publishers and readers).

Callers keep their own delays: request retries 25 ms to 250 ms, Redis
reconnects 0.1 s to 2 s, health watches 0.1 s to 1 s, quota re-tries 0.5 s to 5 s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random

log = logging.getLogger(__name__)

# Past 2**64 the window is max_s anyway; the exponent is bounded so it never overflows.
_MAX_EXPONENT = 64


def exponential_s(attempt: int, base_s: float, max_s: float) -> float:
    """The back-off window before try ``attempt`` (1 is the first): ``base_s`` doubling
    with every try, capped at ``max_s``."""
    return min(max_s, base_s * 2.0 ** min(attempt - 1, _MAX_EXPONENT))


def _check(attempt: int, base_s: float, max_s: float) -> None:
    """Raise ValueError naming the first bad argument."""
    checks = (
        ("attempt", attempt, attempt >= 1, ">= 1"),
        ("base_s", base_s, base_s > 0, "> 0"),
        ("max_s", max_s, max_s >= base_s and math.isfinite(max_s), "finite and >= base_s"),
    )
    for name, value, ok, rule in checks:
        if not ok:
            raise ValueError(f"{name} must be {rule}, got {value!r}")


def backoff_delay_s(
    attempt: int, rng: random.Random, base_s: float = 0.025, max_s: float = 0.25
) -> float:
    """Envoy's fully-jittered exponential back-off before retry number ``attempt``.

    ``attempt`` 1 is the first retry. The delay is uniform in ``[0, min(max_s, base_s *
    2 ** (attempt - 1)))``, as Envoy's ``JitteredExponentialBackOffStrategy`` draws it (the
    first window is ``base_s``, then it doubles up to ``max_s``; Envoy's default max is 10
    times base): with the defaults the windows are 25, 50, 100, 200, then 250 ms.
    """
    _check(attempt, base_s, max_s)
    return rng.random() * exponential_s(attempt, base_s, max_s)


class Backoff:
    """Consecutive failures and the delay each one earns: ``base_s``, doubling, up to
    ``max_s``. No jitter, no clock: the caller sleeps or schedules the delay."""

    def __init__(self, base_s: float, max_s: float) -> None:
        _check(1, base_s, max_s)
        self.base_s = base_s
        self.max_s = max_s
        self.failures = 0

    @property
    def failing(self) -> bool:
        """True after a failure that no success has followed yet."""
        return self.failures > 0

    def next_s(self) -> float:
        """Count one more failure; the delay before the next try."""
        self.failures += 1
        return exponential_s(self.failures, self.base_s, self.max_s)

    def reset(self) -> None:
        """A success: the next failure starts again at ``base_s``."""
        self.failures = 0


class Reconnect:
    """Back-off for a loop reconnecting to a service (0.1 s doubling to 2 s by default),
    logging each outage once (to ``logger``): a warning at its first failure, an info
    when it ends."""

    def __init__(
        self,
        what: str,
        *,
        service: str = "redis",
        base_s: float = 0.1,
        max_s: float = 2.0,
        logger: logging.Logger = log,
    ) -> None:
        self.what = what
        self.service = service
        self.backoff = Backoff(base_s, max_s)
        self.log = logger

    async def failed(self, exc: Exception) -> None:
        """Log the outage if it is new, then sleep the next delay."""
        if not self.backoff.failing:
            fields = {
                "event": f"{self.service}_lost",
                "what": self.what,
                "error": f"{type(exc).__name__}: {exc}",
            }
            self.log.warning(
                "%s: %s unavailable (%s); retrying with back-off",
                *(self.what, self.service, exc),
                extra=fields,
            )
        await asyncio.sleep(self.backoff.next_s())

    def succeeded(self) -> None:
        if self.backoff.failing:
            fields = {"event": f"{self.service}_back", "what": self.what}
            self.log.info("%s: %s is back", self.what, self.service, extra=fields)
        self.backoff.reset()
