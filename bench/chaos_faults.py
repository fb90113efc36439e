"""The fault matrix and one phase of it: steady load, the fault, recovery, a usage snapshot.

A phase runs ``pre_s`` of steady load, injects its fault at ``fault_at``, holds it
``hold_s``, undoes it (SIGCONT, or starting the killed process again: ``meridian up`` does
not restart its children), waits until the target serves again, lets the fleet settle for
``settle_s`` and reads the usage stream. Faults run one at a time, in the order given.

The global tier is not in the matrix: it is the clients' only endpoint (the topology has one
``global`` entry, so ``meridian up`` cannot run two replicas behind one address), and killing
it fails every call by construction.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.chaos_abuse import UnreadStreams
from bench.chaos_fleet import BULK_TENANT, FleetUnderTest
from bench.chaos_load import Load, multi_caller
from bench.chaos_usage import UsageSnapshot, read_usage
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc

LIMITED_TENANT = "free-tier"
VICTIM_ZONE, VICTIM_REGION = "eu-west-1a", "eu-west"


@dataclass(frozen=True)
class Fault:
    name: str
    action: str  # none | sigkill | sigstop | restart | unread | streams
    target: str  # a role of chaos_fleet, or a tenant


FAULTS: tuple[Fault, ...] = (
    Fault("steady", "none", "-"),
    Fault("sigkill-worker", "sigkill", f"worker-{VICTIM_ZONE}"),
    Fault("sigstop-worker", "sigstop", f"worker-{VICTIM_ZONE}"),
    Fault("sigkill-local", "sigkill", f"local-{VICTIM_ZONE}"),
    Fault("sigstop-local", "sigstop", f"local-{VICTIM_ZONE}"),
    Fault("sigkill-regional", "sigkill", f"regional-{VICTIM_REGION}"),
    Fault("sigstop-regional", "sigstop", f"regional-{VICTIM_REGION}"),
    Fault("sigkill-redis", "sigkill", "redis"),
    Fault("sigstop-redis", "sigstop", "redis"),
    Fault("restart-redis", "restart", "redis"),
    Fault("unread-streams", "unread", BULK_TENANT),
    Fault("tenant-streams", "streams", LIMITED_TENANT),
)
QUICK = (
    "steady",
    "sigkill-worker",
    "sigstop-local",
    "sigkill-regional",
    "restart-redis",
    "unread-streams",
    "tenant-streams",
)


@dataclass(frozen=True)
class Timing:
    pre_s: float  # steady load before the fault
    hold_s: float  # how long a process stays killed or stopped
    settle_s: float  # after it serves again, before the next phase
    window_s: float  # how long the abusive streams run (and the slow readers' baseline)


QUICK_TIMING = Timing(pre_s=2.0, hold_s=3.0, settle_s=4.0, window_s=6.0)
FULL_TIMING = Timing(pre_s=3.0, hold_s=5.0, settle_s=6.0, window_s=10.0)


@dataclass(frozen=True)
class Abuse:
    unread_streams: int = 500
    unread_channels: int = 10
    unread_max_tokens: int = 256
    unread_read: bool = False  # a control: the bulk streams are read as they come
    streams: int = 3
    per_stream: int = 20
    stream_max_tokens: int = 600


@dataclass
class Phase:
    """When a phase's events happened (monotonic) and what its fault left behind."""

    fault: Fault
    start: float
    fault_at: float = 0.0
    restore_at: float = 0.0  # SIGCONT sent, restart begun, abusive streams closed
    restored_at: float = 0.0  # the target serves again
    end: float = 0.0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    usage: UsageSnapshot | None = None


@dataclass
class Bench:
    """What a phase acts on."""

    fleet: FleetUnderTest
    load: Load
    stub: pb_grpc.GRPCInferenceServiceStub  # the limited tenant's channel
    timing: Timing
    abuse: Abuse
    rng: random.Random


async def run_phase(bench: Bench, fault: Fault) -> Phase:
    timing = bench.timing
    phase = Phase(fault, time.monotonic())
    await asyncio.sleep(timing.window_s if fault.action in ("unread", "none") else timing.pre_s)
    phase.fault_at = time.monotonic()
    if fault.action in ("sigkill", "sigstop", "restart"):
        await _process_fault(bench, fault, phase)
    elif fault.action == "unread":
        await _unread(bench, phase)
    elif fault.action == "streams":
        await _tenant_streams(bench, phase)
    phase.restore_at = phase.restore_at or phase.fault_at
    phase.restored_at = phase.restored_at or phase.restore_at
    await asyncio.sleep(timing.settle_s)
    phase.usage = await asyncio.to_thread(read_usage, bench.fleet.redis_url)
    phase.end = time.monotonic()
    return phase


async def _process_fault(bench: Bench, fault: Fault, phase: Phase) -> None:
    """SIGKILL (then start again), SIGSTOP (then SIGCONT) or a graceful restart."""
    fleet, role = bench.fleet, fault.target
    if fault.action == "sigstop":
        fleet.send(role, signal.SIGSTOP)
        await asyncio.sleep(bench.timing.hold_s)
        phase.restore_at = time.monotonic()
        fleet.send(role, signal.SIGCONT)
        await asyncio.to_thread(fleet.wait_ready, role, 60.0)
        phase.note = "SIGCONT"
    else:
        graceful = fault.action == "restart"
        sig = signal.SIGTERM if graceful else signal.SIGKILL
        await asyncio.to_thread(fleet.kill, role, sig)
        if not graceful:
            await asyncio.sleep(bench.timing.hold_s)
        phase.restore_at = time.monotonic()
        who = await asyncio.to_thread(fleet.restore, role)
        phase.note = f"started again by {who}"
    phase.restored_at = time.monotonic()


async def _unread(bench: Bench, phase: Phase) -> None:
    abuse = bench.abuse
    streams = UnreadStreams(
        bench.load.target,
        bench.load.keys[BULK_TENANT],
        count=abuse.unread_streams,
        channels=abuse.unread_channels,
        max_tokens=abuse.unread_max_tokens,
        rng=bench.rng,
        read=abuse.unread_read,
    )
    gpus = {"before": await asyncio.to_thread(bench.fleet.gpu_load)}
    phase.fault_at = time.monotonic()
    try:
        streams.open()
        await asyncio.sleep(bench.timing.window_s)
        ended: Counter[str] = await streams.ended_by_server()
        gpus["open"] = await asyncio.to_thread(bench.fleet.gpu_load)
    finally:
        phase.restore_at = time.monotonic()
        await streams.close()
    phase.extra = {
        "streams": abuse.unread_streams,
        "channels": abuse.unread_channels,
        "max_tokens": abuse.unread_max_tokens,
        "read": abuse.unread_read,
        "ended_by_server": dict(ended),
        "gpu_slots": gpus,
    }
    phase.note = f"{abuse.unread_streams} streams over {abuse.unread_channels} connections"
    if abuse.unread_read:
        phase.note += ", read as they come (control)"


async def _tenant_streams(bench: Bench, phase: Phase) -> None:
    abuse = bench.abuse
    until = phase.fault_at + bench.timing.window_s
    callers = [
        multi_caller(
            bench.load,
            bench.stub,
            random.Random(bench.rng.random()),
            LIMITED_TENANT,
            until,
            per_stream=abuse.per_stream,
            max_tokens=abuse.stream_max_tokens,
        )
        for _ in range(abuse.streams)
    ]
    await asyncio.gather(*callers)
    phase.restore_at = until
    phase.extra = {
        "streams_at_once": abuse.streams,
        "requests_per_stream": abuse.per_stream,
        "max_tokens": abuse.stream_max_tokens,
    }
    phase.note = f"{abuse.streams} callers, {abuse.per_stream} requests per stream"
