"""``meridian loadgen``: a bounded run of generate requests from clients around the world.

Each request comes from a city (its ``x-meridian-client-geo``), is unary or a
token stream, and its ``x-meridian-route`` trailer says where it landed. The
report gives latency percentiles, status counts, and the spread over
regions, zones and GPUs.

Progress goes to stderr: a bar (``rich``) on a terminal, otherwise one plain
line every few seconds, so a piped run writes lines, not carriage-return frames.
``meridian loadgen`` exits 1 when any request failed.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc

from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import CLIENT_GEO, ROUTE, trailer
from common.request.v2 import generate_request

CITIES: dict[str, tuple[float, float]] = {
    "new-york": (40.71, -74.01),
    "san-francisco": (37.77, -122.42),
    "sao-paulo": (-23.55, -46.63),
    "london": (51.51, -0.13),
    "frankfurt": (50.11, 8.68),
    "mumbai": (19.08, 72.88),
    "singapore": (1.35, 103.82),
    "tokyo": (35.68, 139.69),
    "sydney": (-33.87, 151.21),
}
PROMPT_WORDS = "the quick brown fox jumps over a lazy dog while routers pick gpus".split()


@dataclass
class LoadReport:
    """What a load run saw."""

    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    routes: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    @property
    def failed(self) -> int:
        return self.total - self.statuses.get("OK", 0)

    def percentile(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def spread(self, depth: int) -> Counter[str]:
        """Requests per route prefix: depth 1 = region, 2 = zone, 3 = GPU."""
        out: Counter[str] = Counter()
        for route, n in self.routes.items():
            out["/".join(route.split("/")[:depth])] += n
        return out

    def render(self) -> str:
        total = self.total
        lines = [
            f"{total} requests in {self.elapsed_s:.1f}s "
            f"({total / max(self.elapsed_s, 1e-9):.1f} req/s)",
            "status   " + ", ".join(f"{k} {v}" for k, v in sorted(self.statuses.items())),
        ]
        if self.latencies_s:
            lines.append(
                "latency  p50 {:.1f} ms  p90 {:.1f} ms  p99 {:.1f} ms  max {:.1f} ms".format(
                    *(1000 * self.percentile(q) for q in (0.5, 0.9, 0.99, 1.0))
                )
            )
        else:  # percentiles of nothing are not a number to print
            lines.append("latency  none: no request succeeded")
        for depth, label in ((1, "region"), (2, "zone"), (3, "gpu")):
            lines.append(f"by {label}:")
            for name, n in sorted(self.spread(depth).items()):
                lines.append(f"  {name:<48} {n:>6}  {100 * n / max(total, 1):5.1f}%")
        return "\n".join(lines)


@dataclass(frozen=True)
class LoadTls:
    """Dial the target with TLS: verified against ``ca`` (a PEM file; None: the system's
    roots), for ``server_name`` when the certificate names something else than the
    target's host."""

    ca: str | None = None
    server_name: str | None = None

    def channel(self, target: str) -> grpc.aio.Channel:
        roots = Path(self.ca).read_bytes() if self.ca else None
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(roots), options)


class Progress:
    """How far a run is, on ``out``: a live bar on a terminal, otherwise a line every
    ``every_s`` seconds and one at the end (never a carriage return)."""

    def __init__(
        self,
        total: int,
        out: TextIO,
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.out, self.every_s, self.clock = total, out, every_s, clock
        self.start = self._last = clock()
        self._bar = None
        if out.isatty():
            from rich.console import Console
            from rich.progress import Progress as Bar

            self._bar = Bar(console=Console(file=out), transient=False)
            self._task = self._bar.add_task("requests", total=total)
            self._bar.start()

    def update(self, report: LoadReport) -> None:
        done = report.total
        if self._bar is not None:
            failed = f"requests, {report.failed} failed" if report.failed else "requests"
            self._bar.update(self._task, completed=done, description=failed)
            if done >= self.total:
                self._bar.stop()
            return
        now = self.clock()
        if done >= self.total or now - self._last >= self.every_s:
            self._last = now
            self.out.write(
                f"loadgen: {done}/{self.total} done, {report.failed} failed, "
                f"{now - self.start:.1f} s\n"
            )
            self.out.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


async def _one(
    stub: pb_grpc.GRPCInferenceServiceStub,
    rng: random.Random,
    model: str,
    max_tokens: int,
    stream: bool,
    report: LoadReport,
    auth: tuple[tuple[str, str], ...],
) -> None:
    city = rng.choice(list(CITIES))
    lat, lon = CITIES[city]
    prompt = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(8, 64)))
    request = generate_request(model, prompt, max_tokens)
    metadata = ((CLIENT_GEO, f"{lat},{lon}"), *auth)
    start = time.perf_counter()
    try:
        if stream:
            call = stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=60)
            async for response in call:
                if response.error_message:
                    raise RuntimeError(response.error_message)
        else:
            call = stub.ModelInfer(request, metadata=metadata, timeout=60)
            await call
        trailers = await call.trailing_metadata()
        report.latencies_s.append(time.perf_counter() - start)
        report.statuses["OK"] += 1
        report.routes[trailer(trailers, ROUTE) or "?"] += 1
    except grpc.aio.AioRpcError as exc:
        report.statuses[exc.code().name] += 1
    except RuntimeError:
        report.statuses["STREAM_ERROR"] += 1


async def run_loadgen(
    target: str,
    *,
    model: str = "demo-llm",
    requests: int = 300,
    concurrency: int = 16,
    max_tokens: int = 16,
    stream_share: float = 0.25,
    seed: int = 7,
    quiet: bool = False,
    api_key: str | None = None,
    tls: LoadTls | None = None,
    progress_every_s: float = 5.0,
) -> LoadReport:
    """Send exactly ``requests`` requests, at most ``concurrency`` at a time (over TLS
    with ``tls``); progress on stderr and the report on stdout unless ``quiet``."""
    rng = random.Random(seed)
    report = LoadReport()
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    queue: asyncio.Queue[bool] = asyncio.Queue()
    for _ in range(requests):
        queue.put_nowait(rng.random() < stream_share)
    progress = None if quiet else Progress(requests, sys.stderr, progress_every_s)
    start = time.perf_counter()
    channel = tls.channel(target) if tls is not None else grpc.aio.insecure_channel(target)
    try:
        async with channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def worker() -> None:
                while not queue.empty():
                    stream = queue.get_nowait()
                    await _one(stub, rng, model, max_tokens, stream, report, auth)
                    if progress is not None:
                        progress.update(report)

            await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    finally:
        if progress is not None:
            progress.close()
    report.elapsed_s = time.perf_counter() - start
    if not quiet:
        print(report.render(), flush=True)
    return report
