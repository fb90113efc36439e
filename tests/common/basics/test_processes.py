"""stop_process over real child processes: asked, waited for, killed when deaf."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from common.basics.processes import stop_process

DEAF = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(flush=True); time.sleep(60)"
)


def test_a_process_that_exits_on_the_signal_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop_process(child, signal.SIGTERM, timeout_s=10)
    assert child.returncode == -signal.SIGTERM


def test_a_process_that_ignores_it_is_killed_after_the_timeout() -> None:
    child = subprocess.Popen([sys.executable, "-c", DEAF], stdout=subprocess.PIPE)
    assert child.stdout is not None
    child.stdout.readline()  # SIGTERM is ignored from here on
    started = time.monotonic()
    stop_process(child, signal.SIGTERM, timeout_s=0.5)
    assert child.returncode == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5
    child.stdout.close()


def test_nothing_to_stop_is_not_an_error() -> None:
    stop_process(None)
    done = subprocess.Popen(["true"])
    done.wait()
    stop_process(done)  # no signal to a reaped pid, which another process may now hold
    assert done.returncode == 0
