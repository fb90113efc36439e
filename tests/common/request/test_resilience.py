import math

import pytest

from common.request.resilience import (
    CircuitBreaker,
    CircuitBreakerConfig,
    OutlierConfig,
    OutlierDetector,
    RetryBudget,
    RetryBudgetConfig,
    SlowStart,
    SlowStartConfig,
)


class FakeClock:
    """Monotonic seconds that only move when a test moves them."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fail(detector: OutlierDetector, key: str, times: int) -> None:
    for _ in range(times):
        detector.record_failure(key)


def detector(clock: FakeClock, total: int = 10, **config: float) -> OutlierDetector:
    return OutlierDetector(OutlierConfig(**config), clock=clock, total_children=total)  # type: ignore[arg-type]


# --- outlier detection --------------------------------------------------------------------


def test_four_consecutive_failures_do_not_eject() -> None:
    od = detector(FakeClock())
    fail(od, "gpu-a", 4)
    assert not od.is_ejected("gpu-a")


def test_fifth_consecutive_failure_ejects() -> None:
    od = detector(FakeClock())
    fail(od, "gpu-a", 5)
    assert od.is_ejected("gpu-a")
    assert od.ejected_keys() == {"gpu-a"}
    assert od.ejection_count("gpu-a") == 1


def test_success_in_between_resets_the_run() -> None:
    od = detector(FakeClock())
    fail(od, "gpu-a", 4)
    od.record_success("gpu-a")
    fail(od, "gpu-a", 4)
    assert not od.is_ejected("gpu-a")
    od.record_failure("gpu-a")
    assert od.is_ejected("gpu-a")


def test_failures_of_one_child_do_not_count_for_another() -> None:
    od = detector(FakeClock())
    fail(od, "gpu-a", 3)
    fail(od, "gpu-b", 3)
    assert od.ejected_keys() == frozenset()


@pytest.mark.parametrize(
    ("ejections", "duration_s"),
    [(1, 30.0), (2, 60.0), (3, 90.0), (10, 300.0), (11, 300.0), (15, 300.0)],
    ids=[
        "first-30s",
        "second-60s",
        "third-90s",
        "tenth-300s",
        "eleventh-capped",
        "fifteenth-capped",
    ],
)
def test_ejection_duration(ejections: int, duration_s: float) -> None:
    clock = FakeClock()
    od = detector(clock)
    for _ in range(ejections - 1):  # back-to-back offences: fail again the moment it returns
        fail(od, "gpu-a", 5)
        while od.is_ejected("gpu-a"):
            clock.advance(1.0)
    fail(od, "gpu-a", 5)
    clock.advance(duration_s - 0.001)
    assert od.is_ejected("gpu-a")
    clock.advance(0.001)
    assert not od.is_ejected("gpu-a")


def test_unejected_lazily_by_is_ejected_alone() -> None:
    clock = FakeClock()
    changes: list[tuple[str, bool]] = []
    od = OutlierDetector(
        clock=clock, total_children=10, on_change=lambda k, e: changes.append((k, e))
    )
    fail(od, "gpu-a", 5)
    assert changes == [("gpu-a", True)]
    clock.advance(30.0)
    assert not od.is_ejected("gpu-a")
    assert changes == [("gpu-a", True), ("gpu-a", False)]
    assert od.ejected_keys() == frozenset()


def test_failures_while_ejected_are_ignored() -> None:
    clock = FakeClock()
    od = detector(clock)
    fail(od, "gpu-a", 5)
    fail(od, "gpu-a", 20)
    assert od.ejection_count("gpu-a") == 1
    clock.advance(30.0)
    fail(od, "gpu-a", 4)  # the run restarts at un-ejection
    assert not od.is_ejected("gpu-a")


@pytest.mark.parametrize(
    ("total", "max_ejected"),
    [(20, 2), (5, 1), (10, 1), (100, 10), (1, 1)],
    ids=["20-children-2", "5-children-at-least-1", "10-children-1", "100-children-10", "single"],
)
def test_max_ejection_percent(total: int, max_ejected: int) -> None:
    od = detector(FakeClock(), total=total)
    for i in range(total):
        fail(od, f"gpu-{i}", 5)
    assert len(od.ejected_keys()) == max_ejected


def test_zero_percent_disables_ejection() -> None:
    od = detector(FakeClock(), max_ejection_percent=0.0)
    fail(od, "gpu-a", 5)
    assert not od.is_ejected("gpu-a")


def test_refused_ejection_needs_a_fresh_run() -> None:
    clock = FakeClock()
    od = detector(clock, total=5)
    fail(od, "gpu-a", 5)
    fail(od, "gpu-b", 5)  # refused: the cap is full, and the run is discarded (Envoy)
    assert od.ejected_keys() == {"gpu-a"}
    clock.advance(30.0)
    od.record_failure("gpu-b")
    assert not od.is_ejected("gpu-b")
    fail(od, "gpu-b", 4)
    assert od.is_ejected("gpu-b")


def test_set_total_widens_the_cap() -> None:
    od = detector(FakeClock(), total=5)
    fail(od, "gpu-a", 5)
    od.set_total(20)
    fail(od, "gpu-b", 5)
    assert od.ejected_keys() == {"gpu-a", "gpu-b"}


def test_ejection_count_decays_after_healthy_interval() -> None:
    clock = FakeClock()
    od = detector(clock)
    fail(od, "gpu-a", 5)
    clock.advance(30.0)
    fail(od, "gpu-a", 5)  # second offence, right after returning
    assert od.ejection_count("gpu-a") == 2
    clock.advance(60.0 + 9.9)
    assert od.ejection_count("gpu-a") == 2
    clock.advance(0.1)  # one healthy interval (10 s) since the ejection ended
    assert od.ejection_count("gpu-a") == 1
    clock.advance(10.0)
    assert od.ejection_count("gpu-a") == 0
    fail(od, "gpu-a", 5)  # a reformed child is back to the base ejection time
    clock.advance(29.9)
    assert od.is_ejected("gpu-a")
    clock.advance(0.1)
    assert not od.is_ejected("gpu-a")


def test_ejection_count_does_not_decay_while_ejected() -> None:
    clock = FakeClock()
    od = detector(clock)
    fail(od, "gpu-a", 5)
    clock.advance(29.0)
    assert od.ejection_count("gpu-a") == 1


def test_forget_drops_a_child() -> None:
    od = detector(FakeClock())
    fail(od, "gpu-a", 5)
    od.forget("gpu-a")
    assert od.ejected_keys() == frozenset()
    assert od.ejection_count("gpu-a") == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("consecutive_failures", 0),
        ("base_ejection_s", 0.0),
        ("max_ejection_s", 10.0),
        ("max_ejection_percent", 101.0),
        ("interval_s", -1.0),
    ],
)
def test_outlier_config_rejects(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        OutlierConfig(**{field: value})  # type: ignore[arg-type]


# --- circuit breaker ----------------------------------------------------------------------


def test_circuit_breaker_refuses_past_max_pending() -> None:
    cb = CircuitBreaker(CircuitBreakerConfig(max_pending=3))
    assert [cb.try_acquire("gpu-a") for _ in range(4)] == [True, True, True, False]
    assert cb.pending("gpu-a") == 3
    assert cb.try_acquire("gpu-b")


def test_circuit_breaker_release_frees_a_slot() -> None:
    cb = CircuitBreaker(CircuitBreakerConfig(max_pending=1))
    assert cb.try_acquire("gpu-a")
    cb.release("gpu-a")
    assert cb.pending("gpu-a") == 0
    assert cb.try_acquire("gpu-a")


def test_circuit_breaker_default_is_1024() -> None:
    cb = CircuitBreaker()
    assert all(cb.try_acquire("gpu-a") for _ in range(1024))
    assert not cb.try_acquire("gpu-a")


def test_circuit_breaker_release_without_acquire_asserts() -> None:
    with pytest.raises(AssertionError):
        CircuitBreaker().release("gpu-a")


def test_circuit_breaker_config_rejects_negative() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        CircuitBreakerConfig(max_pending=-1)


# --- retry budget -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "concurrent"),
    [(0, 3), (10, 3), (17, 3), (20, 4), (100, 20), (1000, 200)],
    ids=[
        "idle-min-3",
        "10-active-min-3",
        "17-active-floor",
        "20-active-4",
        "100-active-20",
        "1000",
    ],
)
def test_retry_budget_concurrency(active: int, concurrent: int) -> None:
    budget = RetryBudget()
    for _ in range(active):
        budget.request_started()
    granted = 0
    while budget.try_start_retry():
        granted += 1
    assert granted == concurrent
    assert budget.active_retries == concurrent
    assert budget.active_requests == active


def test_retry_finished_frees_one() -> None:
    budget = RetryBudget()
    for _ in range(10):
        budget.request_started()
    while budget.try_start_retry():
        pass
    budget.retry_finished()
    assert budget.try_start_retry()
    assert not budget.try_start_retry()


def test_retry_budget_shrinks_when_requests_finish() -> None:
    budget = RetryBudget(RetryBudgetConfig(min_retry_concurrency=0))
    for _ in range(10):
        budget.request_started()
    assert budget.max_retries == 2
    budget.request_finished()
    assert budget.max_retries == 1


def test_retry_budget_underflow_asserts() -> None:
    with pytest.raises(AssertionError):
        RetryBudget().retry_finished()
    with pytest.raises(AssertionError):
        RetryBudget().request_finished()


@pytest.mark.parametrize(
    ("field", "value"), [("budget_percent", 120.0), ("min_retry_concurrency", -1)]
)
def test_retry_budget_config_rejects(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RetryBudgetConfig(**{field: value})  # type: ignore[arg-type]


# --- slow start ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("aggression", "elapsed_s", "factor"),
    [
        (1.0, 0.0, 0.1),
        (1.0, 1.5, 0.1),
        (1.0, 15.0, 0.5),
        (1.0, 29.9, 29.9 / 30),
        (1.0, 30.0, 1.0),
        (1.0, 300.0, 1.0),
        (2.0, 0.0, 0.1),
        (2.0, 7.5, 0.5),
        (2.0, 15.0, math.sqrt(0.5)),
        (0.5, 15.0, 0.25),
    ],
    ids=[
        "floor-at-start",
        "floor-early",
        "linear-half-window",
        "linear-near-end",
        "full-at-window",
        "full-after-window",
        "sqrt-floor-at-start",
        "sqrt-quarter-window",
        "sqrt-half-window",
        "square-half-window",
    ],
)
def test_slow_start_factor(aggression: float, elapsed_s: float, factor: float) -> None:
    clock = FakeClock()
    slow = SlowStart(SlowStartConfig(aggression=aggression), clock=clock)
    slow.start("gpu-a")
    clock.advance(elapsed_s)
    assert slow.factor("gpu-a") == pytest.approx(factor)


def test_slow_start_window_zero_disables() -> None:
    slow = SlowStart(SlowStartConfig(window_s=0.0), clock=FakeClock())
    slow.start("gpu-a")
    assert slow.factor("gpu-a") == 1.0


def test_slow_start_unknown_child_gets_full_share() -> None:
    assert SlowStart(clock=FakeClock()).factor("gpu-a") == 1.0


def test_slow_start_restart_and_forget() -> None:
    clock = FakeClock()
    slow = SlowStart(clock=clock)
    slow.start("gpu-a")
    clock.advance(40.0)
    assert slow.factor("gpu-a") == 1.0
    slow.start("gpu-a")  # recovered: ramps again
    assert slow.factor("gpu-a") == pytest.approx(0.1)
    slow.forget("gpu-a")
    assert slow.factor("gpu-a") == 1.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_s", -1.0),
        ("aggression", 0.0),
        ("aggression", math.inf),
        ("min_weight_percent", 101.0),
    ],
)
def test_slow_start_config_rejects(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SlowStartConfig(**{field: value})
