"""The ``no_leaks`` fixture (tests/conftest.py) fails a test that leaks a task, a
thread or a child process, and passes a clean one.

Each case runs in a pytest subprocess (pytester) whose conftest takes the fixture
from tests/conftest.py, so what the inner test leaks dies with that process and
cannot fail the outer test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

INNER_CONFTEST = """
import subprocess

import pytest

from tests.conftest import no_leaks  # noqa: F401

LEFT: list[subprocess.Popen[bytes]] = []


@pytest.fixture(scope="session", autouse=True)
def reap_leaked_processes():
    # Session scope: runs after no_leaks has looked, so the leak is seen, then cleaned up.
    yield
    for process in LEFT:
        process.kill()
        process.wait()
"""


def run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, body: str) -> Any:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=body)
    return pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-o",
        "asyncio_mode=auto",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
        "-o",
        "timeout=60",
    )


def test_clean_test_passes(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_inner(
        pytester,
        monkeypatch,
        """
import asyncio
import subprocess
import threading


async def test_clean():
    task = asyncio.create_task(asyncio.sleep(0.01), name="short")
    await task
    thread = threading.Thread(target=lambda: None, name="short-thread")
    thread.start()
    thread.join()
    subprocess.run(["true"], check=True)
""",
    )
    result.assert_outcomes(passed=1)


def test_pending_task_fails_the_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_inner(
        pytester,
        monkeypatch,
        """
import asyncio


async def forever():
    await asyncio.Event().wait()


async def test_leaks_a_task():
    asyncio.create_task(forever(), name="leaky-task")
""",
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*left behind*", "*asyncio task 'leaky-task' running forever*"])


def test_task_that_ends_within_the_grace_period_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_inner(
        pytester,
        monkeypatch,
        """
import asyncio


async def test_leaves_a_task_that_ends_soon():
    asyncio.create_task(asyncio.sleep(0.3), name="ends-soon")
""",
    )
    result.assert_outcomes(passed=1)


def test_task_of_a_function_fixture_is_checked_after_its_teardown(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fixture that stops its task in teardown is clean; one that forgets is not."""
    result = run_inner(
        pytester,
        monkeypatch,
        """
import asyncio

import pytest


@pytest.fixture
async def stopped():
    task = asyncio.create_task(asyncio.Event().wait(), name="stopped-task")
    yield
    task.cancel()


@pytest.fixture
async def forgotten():
    asyncio.create_task(asyncio.Event().wait(), name="forgotten-task")
    yield


async def test_stopped(stopped):
    pass


async def test_forgotten(forgotten):
    pass
""",
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_forgotten*left behind*", "*'forgotten-task'*"])
    result.stdout.no_fnmatch_line("*stopped-task*")


def test_thread_fails_the_test(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_inner(
        pytester,
        monkeypatch,
        """
import threading

STOP = threading.Event()


def test_leaks_a_thread():
    threading.Thread(target=STOP.wait, name="leaky-thread", daemon=True).start()
""",
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*left behind*", "*daemon thread 'leaky-thread'*"])


def test_child_process_fails_the_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_inner(
        pytester,
        monkeypatch,
        """
import subprocess

from conftest import LEFT


def test_leaks_a_process():
    LEFT.append(subprocess.Popen(["sleep", "30"]))
""",
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*left behind*", "*child process [0-9]*: sleep 30*"])


def test_process_started_by_a_session_fixture_is_allowed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_inner(
        pytester,
        monkeypatch,
        """
import subprocess
import threading

import pytest


@pytest.fixture(scope="session")
def server():
    process = subprocess.Popen(["sleep", "30"])
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="session-thread")
    thread.start()
    yield
    stop.set()
    thread.join()
    process.kill()
    process.wait()


def test_one(server):
    pass


def test_two(server):
    pass
""",
    )
    result.assert_outcomes(passed=2)


def test_restarting_a_session_fixtures_process_is_not_a_leak(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like a test that kills one tier of a module's fleet and restarts it; a child
    with another command line started alongside is still a leak."""
    result = run_inner(
        pytester,
        monkeypatch,
        """
import subprocess

from conftest import LEFT


def setup_module():
    LEFT.append(subprocess.Popen(["sleep", "30"]))


def test_restarts_it():
    LEFT[0].kill()
    LEFT[0].wait()
    LEFT.append(subprocess.Popen(["sleep", "30"]))


def test_restarts_it_and_starts_another():
    LEFT[-1].kill()
    LEFT[-1].wait()
    LEFT.append(subprocess.Popen(["sleep", "30"]))
    LEFT.append(subprocess.Popen(["sleep", "31"]))
""",
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_restarts_it_and_starts_another left behind*", "*child process [0-9]*: sleep 31*"]
    )
