"""Runs the N worker processes of one tier command and keeps them running (``--workers N``).

What the workers share and what each holds alone is ``cli.workers``. The supervisor
itself serves nothing: it checks that every address its workers will bind is free
(SO_REUSEPORT would otherwise share a port with a stray process of the same user
instead of failing), starts ``meridian <the same command> --worker-index i`` for each
``i``, and then only watches them:

* **SIGTERM or SIGINT**: sent on to every worker as SIGTERM, so each stops gracefully
  (NOT_SERVING, ``--grace`` seconds for its calls in flight); a worker still running
  ``KILL_MARGIN_S`` after that is killed. Exit 0 when every worker exited 0, else 1.
  The workers run in their own process group, so a terminal's Ctrl-C reaches the
  supervisor only and each worker is told once. Each worker asks the kernel for
  SIGTERM should the supervisor die (``cli.processes.die_with_parent``).
* **a worker dies** (any exit the supervisor did not ask for): logged, and the worker
  is started again at once, the others serving meanwhile (its clients' connections
  break; their new ones land on the others). More than ``MAX_RESTARTS`` deaths within
  ``RESTART_WINDOW_S`` (a worker that cannot start, say) is a fault a restart will not
  cure: the supervisor stops the others and exits 1, for the orchestrator to see.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from cli.processes import PARENT_PID_ENV
from common.config.node import ConfigError, Endpoint

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
# After a worker's grace (and its drain notice), how long before it is killed.
KILL_MARGIN_S = 5.0
POLL_S = 0.1


def check_free(addresses: Sequence[Endpoint]) -> None:
    """ConfigError naming the first of ``addresses`` something already listens on.

    Bound without SO_REUSEPORT, so any socket on the port (a listener with
    SO_REUSEPORT included) makes it fail; SO_REUSEADDR lets a port whose old
    connections are in TIME_WAIT pass, as the workers' own binds would."""
    for endpoint in addresses:
        family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((endpoint.host, endpoint.port))
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen on {endpoint.address} for --workers: {exc.strerror}"
                ) from None


@dataclass
class Worker:
    index: int
    popen: subprocess.Popen[bytes]


@dataclass
class Supervisor:
    """Starts ``count`` workers running ``argv`` (the tier command's own arguments,
    ``--workers`` among them) and watches them until told to stop; see the module
    docstring. ``run()`` returns the exit code."""

    argv: Sequence[str]
    count: int
    grace: float
    what: str  # "local tier eu-west-1a", for the log
    max_restarts: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    workers: list[Worker] = field(default_factory=list, init=False)
    _deaths: deque[float] = field(default_factory=deque, init=False)
    _stopping: bool = field(default=False, init=False)

    def _spawn(self, index: int) -> Worker:
        cmd = [sys.executable, "-m", "cli.main", *self.argv, "--worker-index", str(index)]
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        # Its own process group: a terminal's Ctrl-C is the supervisor's to pass on.
        return Worker(index, subprocess.Popen(cmd, env=env, process_group=0))

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        failed = False
        try:
            self.workers = [self._spawn(i) for i in range(self.count)]
            pids = " ".join(str(w.popen.pid) for w in self.workers)
            fields = {"event": "workers_started", "workers": self.count, "pids": pids}
            log.info("%s: %d workers, pids %s", self.what, self.count, pids, extra=fields)
            while not self._stopping and not failed:
                failed = not self._tend()
                time.sleep(POLL_S)
        finally:
            codes = self._stop_all()
        return 1 if failed or any(code != 0 for code in codes) else 0

    def _tend(self) -> bool:
        """Restart any worker that died; False once they die too often to go on."""
        for i, worker in enumerate(self.workers):
            code = worker.popen.poll()
            if code is None or self._stopping:
                continue
            now = self.clock()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > self.window_s:
                self._deaths.popleft()
            fields = {
                "event": "worker_died",
                "worker": worker.index,
                "pid": worker.popen.pid,
                "code": code,
            }
            if len(self._deaths) > self.max_restarts:
                log.error(
                    "%s: worker %d (pid %d) exited with code %s, the %d-th death within "
                    "%g s; stopping the other workers",
                    self.what, worker.index, worker.popen.pid, code, len(self._deaths),
                    self.window_s, extra=fields,
                )  # fmt: skip
                return False
            self.workers[i] = self._spawn(worker.index)
            fields["restarted_pid"] = self.workers[i].popen.pid
            log.warning(
                "%s: worker %d (pid %d) exited with code %s; restarted as pid %d "
                "(%d of at most %d restarts within %g s)",
                self.what, worker.index, worker.popen.pid, code, self.workers[i].popen.pid,
                len(self._deaths), self.max_restarts, self.window_s, extra=fields,
            )  # fmt: skip
        return True

    def _stop_all(self) -> list[int]:
        """SIGTERM to every live worker, then wait (killing the late); their exit codes."""
        for worker in self.workers:
            if worker.popen.poll() is None:
                worker.popen.send_signal(signal.SIGTERM)
        deadline = self.clock() + self.grace + KILL_MARGIN_S + 1.0
        codes = []
        for worker in self.workers:
            try:
                codes.append(worker.popen.wait(max(0.0, deadline - self.clock())))
            except subprocess.TimeoutExpired:
                log.error(
                    "%s: worker %d (pid %d) still running after its grace; killed",
                    self.what, worker.index, worker.popen.pid,
                    extra={"event": "worker_killed", "worker": worker.index},
                )  # fmt: skip
                worker.popen.kill()
                codes.append(worker.popen.wait())
        return codes
