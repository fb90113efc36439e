"""Per-child resilience with Envoy's semantics and defaults.

Outlier ejection (consecutive failures), a pending-request circuit breaker, a retry budget
and slow start (the fully-jittered retry back-off, ``backoff_delay_s``, lives in
``common.basics.backoff``). Everything here is pure and synchronous:
no I/O, no tasks, no module state. Time comes from an injected ``clock`` (monotonic seconds)
and randomness from an injected ``random.Random``, so tests drive timelines without sleeping.
Objects are not thread-safe: each belongs to one event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


def _validate(**checks: tuple[object, bool, str]) -> None:
    """Raise ValueError naming the first field whose check is False."""
    for name, (value, ok, rule) in checks.items():
        if not ok:
            raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Envoy ``outlier_detection`` (consecutive_5xx flavour), same defaults."""

    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 10.0
    interval_s: float = 10.0  # Envoy's ``interval``: the ejection multiplier decays once per tick

    def __post_init__(self) -> None:
        runs, base, top = self.consecutive_failures, self.base_ejection_s, self.max_ejection_s
        pct = self.max_ejection_percent
        _validate(
            consecutive_failures=(runs, runs >= 1, ">= 1"),
            base_ejection_s=(base, base > 0, "> 0"),
            max_ejection_s=(top, top >= base and math.isfinite(top), "finite and >= base"),
            max_ejection_percent=(pct, 0 <= pct <= 100, "in [0, 100]"),
            interval_s=(self.interval_s, self.interval_s > 0, "> 0"),
        )


@dataclass(slots=True)
class _Host:
    consecutive: int = 0
    backoff: int = 0  # Envoy's eject_time_backoff: the ejection-time multiplier
    ejected_until: float | None = None
    healthy_since: float | None = None  # start of the not-ejected stretch the decay counts from


class OutlierDetector:
    """Ejects a child after ``consecutive_failures`` failures in a row, as Envoy does.

    Algorithm: a success resets the run of failures. When the run reaches the threshold the
    counter resets and the child is ejected if fewer than ``max_ejection_percent`` of
    ``total_children`` are ejected now (``100 * ejected / total < percent``), so with any
    percent > 0 one child may always be ejected; 0 disables ejection. An ejection lasts
    ``min(base_ejection_s * multiplier, max_ejection_s)``; the multiplier goes up by one per
    ejection (Envoy stops it one step past the cap) and down by one per full ``interval_s`` the
    child spends not ejected, so repeat offenders stay out longer and reformed ones recover.
    Un-ejection is lazy: whichever call first sees the time is up (``is_ejected`` suffices)
    un-ejects, dating the healthy stretch from the moment the ejection ended, and fires
    ``on_change(key, False)``. Failures reported while ejected are ignored (Envoy ignores them too).

    Failure mode: when a child fails but the percent cap is full, the failure run is discarded
    and the child stays in rotation; with ``total_children`` left at 0 the cap is computed over
    one child. Caches per key only what it must remember (failure run, multiplier, ejection
    deadline); a key with nothing left to remember is dropped, and ``forget`` drops a removed child.
    """

    def __init__(
        self,
        config: OutlierConfig | None = None,
        *,
        clock: Clock = time.monotonic,
        total_children: int = 0,
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._config = config or OutlierConfig()
        self._clock = clock
        self._on_change = on_change
        self._hosts: dict[str, _Host] = {}
        self._ejected: set[str] = set()
        self._total = 0
        self.set_total(total_children)

    def set_total(self, n: int) -> None:
        """Set the number of children the ejection cap is a percentage of."""
        _validate(total_children=(n, n >= 0, ">= 0"))
        self._total = n

    def record_success(self, key: str) -> None:
        host = self._settled(key, self._clock())
        if host is not None:
            host.consecutive = 0
            self._prune(key, host)

    def record_failure(self, key: str) -> None:
        now = self._clock()
        host = self._settled(key, now)
        if host is None:
            host = self._hosts[key] = _Host()
        if host.ejected_until is not None:
            return
        host.consecutive += 1
        if host.consecutive < self._config.consecutive_failures:
            return
        host.consecutive = 0
        if self._room_to_eject(now):
            self._eject(key, host, now)
        else:
            self._prune(key, host)

    def is_ejected(self, key: str) -> bool:
        host = self._settled(key, self._clock())
        if host is None:
            return False
        ejected = host.ejected_until is not None
        self._prune(key, host)
        return ejected

    def ejected_keys(self) -> frozenset[str]:
        self._settle_ejected(self._clock())
        return frozenset(self._ejected)

    def ejection_count(self, key: str) -> int:
        """The current ejection-time multiplier: ejections so far minus healthy intervals."""
        host = self._settled(key, self._clock())
        return 0 if host is None else host.backoff

    def forget(self, key: str) -> None:
        """Drop a child that left the set (no ``on_change`` is fired)."""
        self._hosts.pop(key, None)
        self._ejected.discard(key)

    def _room_to_eject(self, now: float) -> bool:
        self._settle_ejected(now)
        percent = 100.0 * len(self._ejected) / max(self._total, 1)
        return percent < self._config.max_ejection_percent

    def _eject(self, key: str, host: _Host, now: float) -> None:
        cfg = self._config
        if host.backoff * cfg.base_ejection_s < cfg.max_ejection_s + cfg.base_ejection_s:
            host.backoff += 1
        host.ejected_until = now + min(cfg.base_ejection_s * host.backoff, cfg.max_ejection_s)
        host.healthy_since = None
        self._ejected.add(key)
        if self._on_change is not None:
            self._on_change(key, True)

    def _settle_ejected(self, now: float) -> None:
        for key in list(self._ejected):
            self._settled(key, now)

    def _settled(self, key: str, now: float) -> _Host | None:
        """The key's state brought up to ``now``: lazy un-ejection, then multiplier decay."""
        host = self._hosts.get(key)
        if host is None:
            return None
        if host.ejected_until is not None:
            if now < host.ejected_until:
                return host
            host.healthy_since = host.ejected_until
            host.ejected_until = None
            host.consecutive = 0
            self._ejected.discard(key)
            if self._on_change is not None:
                self._on_change(key, False)
        if host.backoff and host.healthy_since is not None:
            ticks = int((now - host.healthy_since) // self._config.interval_s)
            if ticks > 0:
                host.backoff = max(0, host.backoff - ticks)
                host.healthy_since += ticks * self._config.interval_s
        return host

    def _prune(self, key: str, host: _Host) -> None:
        if host.ejected_until is None and host.backoff == 0 and host.consecutive == 0:
            self._hosts.pop(key, None)


@dataclass(frozen=True, slots=True)
class CircuitBreakerConfig:
    """Envoy ``circuit_breakers.thresholds`` (per child here); 1024 is Envoy's default."""

    max_pending: int = 1024

    def __post_init__(self) -> None:
        _validate(max_pending=(self.max_pending, self.max_pending >= 0, ">= 0"))


class CircuitBreaker:
    """Caps requests outstanding to each child at ``max_pending``.

    Algorithm: a counter per key; ``try_acquire`` refuses at the cap, ``release`` gives a slot
    back. Failure mode: a caller that forgets ``release`` leaks a slot until the child is
    refused for good, and a double release is a bug, caught by an assertion. Caches one counter
    per key with requests in flight; a counter that reaches zero is dropped, and ``forget`` drops
    a removed child.
    """

    def __init__(self, config: CircuitBreakerConfig | None = None) -> None:
        self._config = config or CircuitBreakerConfig()
        self._pending: dict[str, int] = {}

    def try_acquire(self, key: str) -> bool:
        count = self._pending.get(key, 0)
        if count >= self._config.max_pending:
            return False
        self._pending[key] = count + 1
        return True

    def release(self, key: str) -> None:
        count = self._pending.get(key, 0)
        assert count > 0, f"release({key!r}) without a matching try_acquire"
        if count == 1:
            del self._pending[key]
        else:
            self._pending[key] = count - 1

    def pending(self, key: str) -> int:
        return self._pending.get(key, 0)

    def forget(self, key: str) -> None:
        """Drop a child that left the set (its counter, if a release is still owed)."""
        self._pending.pop(key, None)


@dataclass(frozen=True, slots=True)
class RetryBudgetConfig:
    """Envoy ``circuit_breakers.thresholds.retry_budget``, same defaults."""

    budget_percent: float = 20.0
    min_retry_concurrency: int = 3

    def __post_init__(self) -> None:
        pct, least = self.budget_percent, self.min_retry_concurrency
        _validate(
            budget_percent=(pct, 0 <= pct <= 100, "in [0, 100]"),
            min_retry_concurrency=(least, least >= 0, ">= 0"),
        )


class RetryBudget:
    """Caps concurrent retries at a share of the traffic, as Envoy's retry budget does.

    Algorithm: a retry may start while ``active_retries < max(min_retry_concurrency,
    floor(budget_percent% * active_requests))``. A request counts once however many times it is
    retried; each retry attempt holds one retry slot until ``retry_finished``. Meant to be shared
    by all the children of one tier (Envoy keeps it per cluster). Failure mode: unbalanced
    start/finish calls skew the budget, so going below zero is caught by an assertion. Caches
    only the two counters.
    """

    def __init__(self, config: RetryBudgetConfig | None = None) -> None:
        self._config = config or RetryBudgetConfig()
        self._requests = 0
        self._retries = 0

    @property
    def active_requests(self) -> int:
        return self._requests

    @property
    def active_retries(self) -> int:
        return self._retries

    @property
    def max_retries(self) -> int:
        share = math.floor(self._config.budget_percent * self._requests / 100.0)
        return max(self._config.min_retry_concurrency, share)

    def request_started(self) -> None:
        self._requests += 1

    def request_finished(self) -> None:
        assert self._requests > 0, "request_finished without request_started"
        self._requests -= 1

    def try_start_retry(self) -> bool:
        if self._retries >= self.max_retries:
            return False
        self._retries += 1
        return True

    def retry_finished(self) -> None:
        assert self._retries > 0, "retry_finished without try_start_retry"
        self._retries -= 1


@dataclass(frozen=True, slots=True)
class SlowStartConfig:
    """Envoy ``slow_start_config``; Envoy has no default window (off), Meridian uses 30 s."""

    window_s: float = 30.0
    aggression: float = 1.0
    min_weight_percent: float = 10.0

    def __post_init__(self) -> None:
        window, agg, floor = self.window_s, self.aggression, self.min_weight_percent
        _validate(
            window_s=(window, window >= 0 and math.isfinite(window), "finite and >= 0"),
            aggression=(agg, agg > 0 and math.isfinite(agg), "finite and > 0"),
            min_weight_percent=(floor, 0 <= floor <= 100, "in [0, 100]"),
        )


def ramp_factor(elapsed_s: float, config: SlowStartConfig) -> float:
    """Slow start's share ``elapsed_s`` after a start: from the floor up to 1.0 at the window."""
    if config.window_s <= 0 or elapsed_s >= config.window_s:
        return 1.0
    ramp = (max(elapsed_s, 0.0) / config.window_s) ** (1.0 / config.aggression)
    return max(config.min_weight_percent / 100.0, ramp)


class SlowStart:
    """Ramps a new or just-recovered child's share up over ``window_s``, as Envoy's slow start.

    Algorithm: ``factor = max(min_weight_percent / 100, (elapsed / window_s) ** (1 /
    aggression))`` while ``elapsed < window_s``, else 1.0; aggression 1 is linear, larger values
    ramp faster early on. A picker multiplies a child's weight (or divides its cost) by the factor.
    Window 0 disables slow start. Failure mode: a child never passed to ``start`` gets its full
    share at once. Caches each child's start time only while its window runs; a lookup after the
    window drops the entry, and ``forget`` drops a removed child.
    """

    def __init__(
        self, config: SlowStartConfig | None = None, *, clock: Clock = time.monotonic
    ) -> None:
        self._config = config or SlowStartConfig()
        self._clock = clock
        self._started: dict[str, float] = {}

    def start(self, key: str) -> None:
        """The child was added or has just recovered: begin (or restart) its ramp now."""
        if self._config.window_s > 0:
            self._started[key] = self._clock()

    def factor(self, key: str) -> float:
        started = self._started.get(key)
        if started is None:
            return 1.0
        elapsed = self._clock() - started
        if elapsed >= self._config.window_s:
            del self._started[key]
            return 1.0
        return ramp_factor(elapsed, self._config)

    def forget(self, key: str) -> None:
        self._started.pop(key, None)
