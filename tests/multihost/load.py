"""Paced, bounded load through a door, and what it saw, second by second.

``PacedLoad`` runs ``clients`` threads, each a stock gRPC client sending one request at a
time at no more than ``rate_per_s / clients`` a second (a closed loop would take every core
this shared machine has), until stopped or ``max_requests`` were sent. Every request is a
``Sample`` (``tests.client``): when it started and ended (``time.monotonic()``, one clock for
every process on the machine), its status and the region that served it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

import grpc

from tests.client import Sample, V2Client, region_of


class PacedLoad:
    def __init__(
        self,
        target: str,
        metadata: Sequence[tuple[str, str]],
        *,
        clients: int = 4,
        rate_per_s: float = 80.0,
        max_requests: int = 20_000,
        timeout_s: float = 10.0,
    ) -> None:
        self.target = target
        self.metadata = tuple(metadata)
        self.interval_s = clients / rate_per_s
        self.max_requests = max_requests
        self.timeout_s = timeout_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> PacedLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)

    def _take_turn(self) -> bool:
        with self._lock:
            if self._sent >= self.max_requests:
                return False
            self._sent += 1
            return True

    def _run(self) -> None:
        with V2Client(self.target) as client:
            next_at = time.monotonic()
            while not self._stop.is_set() and self._take_turn():
                start = time.monotonic()
                try:
                    reply = client.infer("load", 4, metadata=self.metadata, timeout=self.timeout_s)
                    sample = Sample(start, time.monotonic(), grpc.StatusCode.OK, reply.route)
                except grpc.RpcError as err:
                    sample = Sample(start, time.monotonic(), err.code(), "")
                with self._lock:
                    self.samples.append(sample)
                next_at = max(next_at + self.interval_s, time.monotonic() - self.interval_s)
                self._stop.wait(max(0.0, next_at - time.monotonic()))

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return sorted(self.samples, key=lambda s: s.started)


def buckets(
    samples: Sequence[Sample], start: float, end: float, width_s: float = 1.0
) -> list[tuple[float, Counter[str]]]:
    """Requests started in each ``width_s`` from ``start``: by serving region, ``FAILED``
    for the ones that failed (keyed by the bucket's start, relative to ``start``); a last
    bucket that would end after ``end`` is left out."""
    out: list[tuple[float, Counter[str]]] = []
    t = start
    while t + width_s <= end + 1e-9:
        count: Counter[str] = Counter()
        for s in samples:
            if t <= s.started < t + width_s:
                count[region_of(s.route) if s.code == grpc.StatusCode.OK else "FAILED"] += 1
        out.append((round(t - start, 3), count))
        t += width_s
    return out
