"""Stopping a child process: ask it with a signal, give it time, then kill it."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def stop_process(
    process: subprocess.Popen[Any] | None,
    sig: int | None = signal.SIGTERM,
    timeout_s: float = 10.0,
) -> None:
    """Send ``sig`` to ``process`` if it still runs (None: it was sent already) and wait up
    to ``timeout_s`` for it to exit; one that does not is killed. Either way it is reaped
    (no zombie is left)."""
    if process is None or process.poll() is not None:
        return
    if sig is not None:
        process.send_signal(sig)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
