"""The data-plane bench's closed-loop driver and its CPU accounting from /proc.

``python -m bench.data_plane_load`` is a long-lived process that reads one JSON job a
line on stdin (``Job``), prints ``begin`` and ``end`` when the measured window opens
and closes (so the bench samples the other processes' CPU at the same instants), then
one JSON line (``Window``). ``concurrency`` clients each send the next generate request when the
last one is answered, unary (ModelInfer) or one ModelStreamInfer stream per request
(write, half-close, read to the end, as a token-streaming client does); clients are
spread over ``targets`` (the direct row: every GPU). A reply that is an error, or a
stream response with ``error_message``, is counted as an error, never as done.

``ProcCpu`` reads utime+stime of a process and its descendants from ``/proc/PID/stat``
(clock ticks: 10 ms resolution, so windows should be seconds long).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass
class Job:
    targets: list[str]
    mode: str  # unary | stream
    model: str
    concurrency: int = 32
    seconds: float = 3.0
    warmup_s: float = 0.5
    max_tokens: int = 1
    api_key: str = ""
    # Mutual TLS to the target: the CA and the certificate the client presents.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # Connections (channels) per target, the clients spread over them: a tier run with
    # --workers N shares its port per connection (SO_REUSEPORT), so one connection
    # would reach one worker only.
    connections: int = 1


@dataclass
class Window:
    done: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_s: float  # this driver's own CPU over the window
    first_error: str = ""
    latencies_ms: list[float] = field(default_factory=list, repr=False)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def channel_for(job: Job, target: str) -> grpc.aio.Channel:
    # Each channel its own connection: grpcio otherwise shares one between a process's
    # channels to the same target.
    options = [("grpc.use_local_subchannel_pool", 1)] if job.connections > 1 else []
    if not job.tls_ca:
        return grpc.aio.insecure_channel(target, options=options)
    ca, cert, key = (Path(p).read_bytes() for p in (job.tls_ca, job.tls_cert, job.tls_key))
    creds = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(target, creds, options=options)


class Loop:
    """``job.concurrency`` clients over one channel per target; counts only while open."""

    def __init__(self, job: Job, stubs: list[pb_grpc.GRPCInferenceServiceStub]) -> None:
        self.job = job
        self.stubs = stubs
        self.metadata = (("authorization", f"Bearer {job.api_key}"),) if job.api_key else ()
        self.request = generate_request(
            job.model, "hello", job.max_tokens, stream=job.mode == "stream"
        )
        self.counting = False
        self.stopping = False
        self.latencies: list[float] = []
        self.errors = 0
        self.first_error = ""

    async def one(self, stub: pb_grpc.GRPCInferenceServiceStub) -> str:
        """One request; '' when answered, else what went wrong."""
        if self.job.mode == "unary":
            reply = await stub.ModelInfer(self.request, metadata=self.metadata, timeout=10)
            return "" if reply.outputs else "reply without outputs"
        call = stub.ModelStreamInfer(metadata=self.metadata, timeout=10)
        await call.write(self.request)
        await call.done_writing()
        answered = ""
        async for response in call:
            if response.error_message:
                return response.error_message
            answered = "" if response.infer_response.outputs else "response without outputs"
        return answered

    async def client(self, stub: pb_grpc.GRPCInferenceServiceStub) -> None:
        while not self.stopping:
            started = time.perf_counter()
            try:
                error = await self.one(stub)
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            if not self.counting:
                continue
            if error:
                self.errors += 1
                self.first_error = self.first_error or error
            else:
                self.latencies.append(time.perf_counter() - started)


def no_mark(event: str) -> None:
    return None


async def run_job(job: Job, mark: Callable[[str], None] = no_mark) -> Window:
    """Warm up, then measure ``job.seconds``; ``mark`` is called with ``begin`` and
    ``end`` the moment the window opens and closes."""
    channels = [channel_for(job, t) for t in job.targets for _ in range(job.connections)]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
        loop = Loop(job, stubs)
        clients = [
            asyncio.create_task(loop.client(stubs[i % len(stubs)])) for i in range(job.concurrency)
        ]
        await asyncio.sleep(job.warmup_s)
        loop.counting = True
        opened, cpu0 = time.perf_counter(), time.process_time()
        mark("begin")
        await asyncio.sleep(job.seconds)
        loop.counting, loop.stopping = False, True
        mark("end")
        wall, cpu = time.perf_counter() - opened, time.process_time() - cpu0
        await asyncio.gather(*clients)  # the last calls finish, uncounted
    finally:
        for channel in channels:
            await channel.close()
    ms = [x * 1000.0 for x in loop.latencies]
    return Window(
        done=len(ms),
        errors=loop.errors,
        seconds=wall,
        rps=len(ms) / wall,
        p50_ms=statistics.median(ms) if ms else float("nan"),
        p99_ms=percentile(ms, 0.99),
        cpu_s=cpu,
        first_error=loop.first_error,
    )


async def serve_jobs() -> None:
    """The stdin/stdout protocol: a Job a line in; ``begin`` then a Window a line out."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        try:
            window = await run_job(Job(**json.loads(line)), say)
        except Exception as exc:  # the bench reads the reason instead of waiting forever
            print(json.dumps({"failed": f"{type(exc).__name__}: {exc}"}), flush=True)
            continue
        print(json.dumps(asdict(window)), flush=True)


def say(event: str) -> None:
    print(event, flush=True)


# --- CPU accounting -------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its ')'.
    return text[text.rindex(")") + 2 :].split()


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` (all its threads), in clock ticks; 0 if it is gone."""
    try:
        fields = _stat_fields(pid)
    except (OSError, ValueError):
        return 0
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (nginx's workers, a --workers tier's)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(_stat_fields(int(entry.name))[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(parents.get(current, []))
    return found


@dataclass
class ProcCpu:
    """CPU seconds of named process trees between ``start`` and ``stop``."""

    roots: dict[str, int]
    _pids: dict[str, list[int]] = field(default_factory=dict)
    _before: dict[str, int] = field(default_factory=dict)

    def _ticks(self) -> dict[str, int]:
        return {name: sum(cpu_ticks(p) for p in pids) for name, pids in self._pids.items()}

    def start(self) -> None:
        self._pids = {name: descendants(pid) for name, pid in self.roots.items()}
        self._before = self._ticks()

    def stop(self) -> dict[str, float]:
        after = self._ticks()
        return {name: (after[name] - self._before[name]) * TICK_S for name in after}


def main() -> None:
    asyncio.run(serve_jobs())


if __name__ == "__main__":
    main()
