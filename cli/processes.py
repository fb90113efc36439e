"""One process a launcher starts: how it starts, stops and dies with its launcher.

``TierProcess`` starts a command with its output in a log file, optionally behind
a start gate (``cli.launcher.Fleet.start``), and stops it (``stop_process``).
Each child asks the kernel to end it when the launcher dies
(``die_with_parent``, PR_SET_PDEATHSIG, set by the child at start), so even a
killed launcher leaves no process behind. ``ExitWatch`` reports a process that
died once, and once when it is back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from common.basics.processes import stop_process

_PR_SET_PDEATHSIG = 1


PARENT_PID_ENV = "MERIDIAN_PARENT_PID"
# Where a process launched by a Fleet finds its start gate (``TierProcess.start``).
START_GATE_ENV = "MERIDIAN_START_GATE"


def die_with_parent() -> None:
    """In a launched process: ask the kernel for SIGTERM when the launcher dies.

    Called by the child itself at start-up (``preexec_fn`` would run Python
    between fork and exec, which can deadlock a launcher that has threads).
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the launcher died before we could ask
        raise SystemExit(1)


@dataclass
class TierProcess:
    """One launched process and how to start it again."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = field(default=None, repr=False)

    def start(self, gate: int | None = None) -> None:
        """Start it; with ``gate`` (a pipe's read end), a ``meridian`` tier or worker
        loads its code, then waits for the pipe to close before it builds and serves
        (``cli.main``)."""
        self.log_file = self.log_path.open("ab")
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        if gate is not None:
            env[START_GATE_ENV] = str(gate)
        self.process = subprocess.Popen(
            self.argv,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            pass_fds=() if gate is None else (gate,),
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` if it still runs, without waiting (``stop`` waits)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, sig: int | None = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """``sig`` (None: already sent with ``send_signal``), then wait, then kill."""
        stop_process(self.process, sig, timeout_s)
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


@dataclass
class ExitWatch:
    """Says once that a launched process died, and once that it is back.

    ``poll()`` (``meridian up`` calls it every half second) returns the lines to
    print: a warning when a process is first seen dead, then nothing while it
    stays dead; a line when it runs again (``Fleet.restart``), or when what it
    served answers again although the launcher did not start it (someone ran
    it by hand from the run directory's topology) — ``answers`` probes that, at
    most every ``probe_interval_s``, and a warning follows if it stops answering.
    """

    processes: Mapping[str, TierProcess]
    answers: Callable[[str], bool]
    probe_interval_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    # name -> (state, next probe time); a process not in it is up
    _state: dict[str, tuple[str, float]] = field(default_factory=dict)

    def poll(self) -> list[str]:
        now = self.clock()
        return [line for name in self.processes if (line := self._check(name, now))]

    def _check(self, name: str, now: float) -> str:
        proc = self.processes[name]
        state, next_probe = self._state.get(name, ("up", 0.0))
        if proc.alive():
            self._state.pop(name, None)
            return "" if state == "up" else f"{name} is running again"
        if state == "up":
            self._state[name] = ("down", now + self.probe_interval_s)
            code = proc.process.returncode if proc.process is not None else None
            return f"warning: {name} exited (code {code}); see {proc.log_path}"
        if now < next_probe:
            return ""
        answering = self.answers(name)
        self._state[name] = ("elsewhere" if answering else "down", now + self.probe_interval_s)
        if state == "down" and answering:
            return f"{name} answers again (a process this launcher did not start)"
        if state == "elsewhere" and not answering:
            return f"warning: {name} stopped answering; see {proc.log_path}"
        return ""
