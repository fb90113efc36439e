"""How far ``meridian sim run`` is: requests fed over every run, from every worker process.

A 1024-GPU run of a million requests takes minutes, so the bar moves with the
requests each run has fed (``sim.run``'s progress callback, every 1000), not
only when a run ends. Worker processes report through a managed queue, whose
proxy travels with each run (a plain multiprocessing queue cannot be pickled
into a pool's task). On a terminal the bar is redrawn in place; otherwise a line
every ``every_s`` seconds and one per finished run, so a log or CI shows it
without carriage returns.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import replace
from typing import Any, TextIO

from sim.results import PolicyResult
from sim.run import RunSpec, run_with_events

RunKey = tuple[str, str]  # (scenario, policy)
Timed = tuple[PolicyResult, list[tuple[float, str]]]  # run_with_events's result

# A worker's runs, set by ``_take_specs`` when the pool forks it: under ``fork`` a
# pool's ``initargs`` are inherited, not pickled, and a spec holds frozen dataclasses,
# which a module compiled with mypyc (``sim.native``) cannot unpickle. The parent
# process never sets it.
_worker_specs: tuple[RunSpec, ...] = ()


def _take_specs(specs: tuple[RunSpec, ...]) -> None:
    global _worker_specs
    _worker_specs = specs


def _run_in_worker(index: int, key: RunKey, reports: Any) -> Timed:
    def fed(n: int) -> None:
        reports.put((key, n))

    return timed_run(_worker_specs[index], fed)


def timed_run(spec: RunSpec, progress: Callable[[int], None]) -> Timed:
    """``run_with_events``, the result carrying the wall time it took and the arrivals
    it was fed (a replayed trace may hold fewer than ``spec.requests``)."""
    fed = [0]

    def counted(n: int) -> None:
        fed[0] = n
        progress(n)

    started = time.monotonic()
    result, events = run_with_events(spec, counted)
    timed = replace(
        result,
        sim_wall_s=round(time.monotonic() - started, 1),
        sim_requests=fed[0],
    )
    return timed, events


def run_key(spec: RunSpec) -> RunKey:
    return spec.scenario.name, spec.policy


class RunProgress:
    """Requests fed out of ``runs`` × ``per_run`` (a replayed trace may hold fewer)."""

    def __init__(
        self,
        runs: int,
        per_run: int,
        out: TextIO,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runs, self.per_run, self.out = runs, per_run, out
        self.every_s, self.clock = every_s, clock
        self.fed: dict[RunKey, int] = {}
        self.finished = 0
        self.started = self._last = clock()
        self.tty = out.isatty()

    @property
    def total(self) -> int:
        return self.runs * self.per_run

    @property
    def done(self) -> int:
        return sum(self.fed.values())

    def fed_so_far(self, key: RunKey, n: int) -> None:
        self.fed[key] = max(n, self.fed.get(key, 0))
        now = self.clock()
        if now - self._last >= (0.5 if self.tty else self.every_s):
            self._last = now
            self._show("")

    def run_ended(self, key: RunKey, what: str) -> None:
        self.finished += 1
        self.fed[key] = self.per_run
        self._show(what, final=True)

    def _show(self, what: str, final: bool = False) -> None:
        done, total = self.done, max(1, self.total)
        elapsed = self.clock() - self.started
        width = 30
        filled = width * min(done, total) // total
        rate = f"{done / elapsed:,.0f} req/s" if elapsed > 0 else ""
        text = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.finished}/{self.runs} runs, "
            f"{done:,}/{total:,} requests, {elapsed:.0f}s {rate} {what}".rstrip()
        )
        if self.tty:
            end = "\n" if self.finished == self.runs and final else ""
            self.out.write(f"\r{text[:120]:<120}{end}")
        elif final or not what:
            self.out.write(text + "\n")
        self.out.flush()


def simulate(specs: Sequence[RunSpec], jobs: int, out: TextIO) -> dict[RunKey, Timed]:
    """Run every spec, ``jobs`` at a time (worker processes when more than one)."""
    bar = RunProgress(len(specs), max(s.requests for s in specs), out)
    results: dict[RunKey, Timed] = {}
    if jobs == 1:
        for spec in specs:
            key = run_key(spec)
            results[key] = timed_run(spec, _reporter(bar, key))
            bar.run_ended(key, f"{key[0]} / {key[1]}")
        return results
    fork = multiprocessing.get_context("fork")
    with (
        multiprocessing.Manager() as manager,
        ProcessPoolExecutor(jobs, fork, initializer=_take_specs, initargs=(tuple(specs),)) as pool,
    ):
        reports = manager.Queue()
        pending: dict[Future[Timed], RunKey] = {
            pool.submit(_run_in_worker, i, run_key(s), reports): run_key(s)
            for i, s in enumerate(specs)
        }
        while pending:
            ended, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            _drain(reports, bar)
            for future in ended:
                key = pending.pop(future)
                results[key] = future.result()
                bar.run_ended(key, f"{key[0]} / {key[1]}")
    return results


def _reporter(bar: RunProgress, key: RunKey) -> Callable[[int], None]:
    def fed(n: int) -> None:
        bar.fed_so_far(key, n)

    return fed


def _drain(reports: Any, bar: RunProgress) -> None:
    while True:
        try:
            key, n = reports.get_nowait()
        except queue.Empty:
            return
        bar.fed_so_far(key, n)
