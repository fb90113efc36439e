"""The one back-off: its formula, the jittered retry delay, the failure counter and
the reconnect helper (one named case per row)."""

import asyncio
import logging
import random

import pytest

from common.basics.backoff import Backoff, Reconnect, backoff_delay_s, exponential_s

# --- the formula --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "base_s", "max_s", "window_s"),
    [
        (1, 0.025, 0.25, 0.025),
        (4, 0.025, 0.25, 0.2),
        (5, 0.025, 0.25, 0.25),
        (1, 0.1, 2.0, 0.1),
        (5, 0.1, 2.0, 1.6),
        (6, 0.1, 2.0, 2.0),
        (4, 0.1, 1.0, 0.8),
        (5, 0.1, 1.0, 1.0),
        (4, 0.5, 5.0, 4.0),
        (5, 0.5, 5.0, 5.0),
        (10**9, 0.5, 5.0, 5.0),
    ],
    ids=[
        "retry-first-25ms",
        "retry-fourth-200ms",
        "retry-capped-250ms",
        "redis-first-100ms",
        "redis-fifth-1.6s",
        "redis-capped-2s",
        "watch-fourth-800ms",
        "watch-capped-1s",
        "quota-fourth-4s",
        "quota-capped-5s",
        "huge-attempt-no-overflow",
    ],
)
def test_exponential_window(attempt: int, base_s: float, max_s: float, window_s: float) -> None:
    assert exponential_s(attempt, base_s, max_s) == pytest.approx(window_s)


# --- the jittered retry delay -------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "cap_s"),
    [(1, 0.025), (2, 0.05), (3, 0.1), (4, 0.2), (5, 0.25), (6, 0.25), (10_000, 0.25)],
    ids=["first-retry-25ms", "50ms", "100ms", "200ms", "capped-250ms", "still-250ms", "huge"],
)
def test_backoff_upper_bound(attempt: int, cap_s: float) -> None:
    rng = random.Random(7)
    samples = [backoff_delay_s(attempt, rng) for _ in range(2000)]
    assert all(0.0 <= s < cap_s for s in samples)
    assert max(samples) > 0.99 * cap_s  # fully jittered: the whole window is used
    assert min(samples) < 0.01 * cap_s


def test_backoff_grows_with_attempt() -> None:
    rng = random.Random(11)
    means = [sum(backoff_delay_s(a, rng) for _ in range(2000)) / 2000 for a in range(1, 6)]
    assert means == sorted(means)
    assert means[-1] > 4 * means[0]


def test_backoff_is_deterministic_for_a_seeded_rng() -> None:
    first = [backoff_delay_s(a, random.Random(3)) for a in range(1, 8)]
    again = [backoff_delay_s(a, random.Random(3)) for a in range(1, 8)]
    assert first == again


def test_backoff_honours_custom_base_and_max() -> None:
    rng = random.Random(5)
    assert all(backoff_delay_s(3, rng, base_s=1.0, max_s=2.0) < 2.0 for _ in range(100))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"attempt": 0}, "attempt"),
        ({"attempt": 1, "base_s": 0.0}, "base_s"),
        ({"attempt": 1, "base_s": 0.5, "max_s": 0.1}, "max_s"),
    ],
)
def test_backoff_rejects(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        backoff_delay_s(rng=random.Random(0), **kwargs)  # type: ignore[arg-type]


# --- the failure counter ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base_s", "max_s", "expected"),
    [
        (0.1, 2.0, [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]),
        (0.1, 1.0, [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]),
        (0.5, 5.0, [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]),
    ],
    ids=["redis-reconnect", "health-watch", "quota-retry"],
)
def test_backoff_doubles_to_its_cap(base_s: float, max_s: float, expected: list[float]) -> None:
    backoff = Backoff(base_s, max_s)
    assert [backoff.next_s() for _ in expected] == expected  # exact: doubling is exact


def test_backoff_reset_starts_again_at_base() -> None:
    backoff = Backoff(0.1, 2.0)
    assert not backoff.failing
    backoff.next_s(), backoff.next_s()
    assert backoff.failing
    backoff.reset()
    assert not backoff.failing and backoff.next_s() == 0.1


@pytest.mark.parametrize(("base_s", "max_s", "name"), [(0.0, 1.0, "base_s"), (1.0, 0.5, "max_s")])
def test_backoff_rejects_bad_bounds(base_s: float, max_s: float, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Backoff(base_s, max_s)


# --- the reconnect helper -----------------------------------------------------------------


async def test_reconnect_logs_an_outage_once_and_its_end(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.reconnect")
    caplog.set_level(logging.INFO, logger="test.reconnect")
    reconnect = Reconnect("reader", base_s=0.001, max_s=0.004, logger=logger)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(4):
        await reconnect.failed(ConnectionError("refused"))
    slept = loop.time() - started
    assert slept >= 0.001 + 0.002 + 0.004 + 0.004 - 0.001  # it waited the back-off
    reconnect.succeeded()
    reconnect.succeeded()  # no outage: nothing more to say
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "test.reconnect"]
    assert messages == [
        (logging.WARNING, "reader: redis unavailable (refused); retrying with back-off"),
        (logging.INFO, "reader: redis is back"),
    ]
    assert reconnect.backoff.next_s() == 0.001  # a new outage starts at base again
