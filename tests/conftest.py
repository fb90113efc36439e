"""Shared fixtures: a real embedded Redis and real multi-process fleets on loopback,
and ``no_leaks``, which fails a test that leaves a task, a thread or a child process behind."""

from __future__ import annotations

import asyncio
import copy
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.launcher import DEMO_FLEET, Fleet
from common.basics.redis_embed import EmbeddedRedis

# Emulated GPUs run 20x faster than real time in tests.
TEST_TIME_SCALE = 0.05


def _started_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    yield from _started_redis()


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own: to stop, restart, count commands or connections on."""
    yield from _started_redis()


def demo_fleet_spec() -> dict[str, Any]:
    """The demo fleet, moved off the fixed port 8001 so tests never clash with `make up`."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["global"]["listen"] = "127.0.0.1:0"
    spec["global"]["ops_listen"] = "127.0.0.1:0"  # and off the demo's fixed ops port 8002
    spec["global"]["openai_listen"] = "127.0.0.1:0"  # and off its OpenAI HTTP port 8000
    spec["time_scale"] = TEST_TIME_SCALE
    # Routing tests call without API keys; tests/e2e/test_tenants.py turns auth on.
    spec["auth"] = {"enabled": False, "tenants": []}
    return spec


def small_fleet_spec(regions: int = 2, zones: int = 2, gpus: int = 1) -> dict[str, Any]:
    """A cut-down demo fleet: fewer regions, zones and GPUs, same coordinates."""
    spec = demo_fleet_spec()
    spec["regions"] = spec["regions"][:regions]
    for region in spec["regions"]:
        region["zones"] = region["zones"][:zones]
        for zone in region["zones"]:
            zone["gpus"] = zone["gpus"][:gpus]
    return copy.deepcopy(spec)


def start_fleet(tmp: Path, spec: dict[str, Any], policy: str = "default") -> Fleet:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(spec))
    fleet = Fleet(path, tmp / "run", policy=policy)
    fleet.start(timeout_s=90)
    return fleet


@pytest.fixture(scope="module")
def demo_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The whole demo fleet (3 regions x 2 zones x 4 GPUs), shared by a module's read-only
    tests. Module-scoped: idle, its processes (health checks, summaries, scrapes) take a
    third of a core, which a session fixture took from every test after it to the end."""
    fleet = start_fleet(tmp_path_factory.mktemp("demo"), demo_fleet_spec())
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    """Start fleets a test may break; every one is stopped when the test ends."""
    fleets: list[Fleet] = []

    def make(spec: dict[str, Any], policy: str = "default") -> Fleet:
        fleet = start_fleet(tmp_path / f"fleet{len(fleets)}", spec, policy)
        fleets.append(fleet)
        return fleet

    try:
        yield make
    finally:
        # Side by side: a fleet's stop is mostly waiting for its tiers to drain.
        with ThreadPoolExecutor(max_workers=max(1, len(fleets))) as pool:
            list(pool.map(Fleet.stop, fleets))


# ---------------------------------------------------------------- leak check

# How long a test's leftovers get to go away by themselves (a killed process takes
# a moment to be reaped, a cancelled task a few loop turns to finish).
LEAK_GRACE_S = 2.0
LEAK_POLL_S = 0.05

# Daemon threads that library internals start once and keep for the life of the
# process: the first test to touch the library starts them, and no test can stop them.
# Matched against the whole thread name; a thread must also be a daemon to be let off.
PROCESS_LIFETIME_THREADS: dict[str, str] = {
    # grpc.aio's poller: one per process, started by the first aio channel or server and
    # stopped only when the last of them is deallocated (grpc's refcount, at GC's pleasure).
    r"Thread-\d+ \(_poll_wrapper\)": "grpc.aio PollerCompletionQueue",
}
_LIFETIME_THREAD = re.compile("|".join(f"(?:{p})" for p in PROCESS_LIFETIME_THREADS) or "(?!)")


def child_pids() -> dict[int, str]:
    """This process's direct children (from /proc, zombies included) and their command lines."""
    me = os.getpid()
    out: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) != me:
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue  # it went away while we looked
        out[int(entry.name)] = cmdline or f"<{state}>"
    return out


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[threading.Thread]
    children: dict[int, str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(frozenset(threading.enumerate()), child_pids())


def leftovers(before: Snapshot, loop: asyncio.AbstractEventLoop | None) -> list[str]:
    """What exists now and did not at ``before``, each named for the failure message."""
    found = []
    if loop is not None and not loop.is_closed():
        for task in asyncio.all_tasks(loop):
            if not task.done():
                coro = task.get_coro()
                name = getattr(coro, "__qualname__", repr(coro))
                found.append(f"asyncio task {task.get_name()!r} running {name}")
    for thread in threading.enumerate():
        if thread in before.threads or not thread.is_alive():
            continue
        if thread.daemon and _LIFETIME_THREAD.fullmatch(thread.name):
            continue
        kind = "daemon thread" if thread.daemon else "thread"
        found.append(f"{kind} {thread.name!r}")
    now = child_pids()
    # A test that kills a process of a wider-scoped fixture (a module's fleet) and
    # restarts it leaves that fixture as it found it: a new child with the command line
    # of one that went away during the test is that restart, owned by the fixture.
    restarted = Counter(cmd for pid, cmd in before.children.items() if pid not in now)
    for pid, cmdline in sorted(now.items()):
        if pid in before.children:
            continue
        if restarted[cmdline] > 0:
            restarted[cmdline] -= 1
            continue
        found.append(f"child process {pid}: {cmdline}")
    return found


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves behind an asyncio task, a thread or a child process.

    Autouse and function-scoped, so pytest sets it up after every wider-scoped
    fixture (the shared Redis, module fleets: what they start is in the
    snapshot) and before the test's other function-scoped fixtures, and tears
    it down after them. It takes the test's event loop (pytest-asyncio's
    function-scoped runner) first, so that loop outlives the other fixtures'
    teardown and its tasks can be inspected before the runner cancels them.
    Leftovers get ``LEAK_GRACE_S`` to finish (the loop keeps turning meanwhile);
    daemon threads in ``PROCESS_LIFETIME_THREADS`` are allowed, and so is a child
    that replaces one of a wider-scoped fixture the test killed (same command line).
    """
    runner = request.getfixturevalue("_function_scoped_runner")
    loop: asyncio.AbstractEventLoop = runner.get_loop()
    before = Snapshot.take()
    yield
    # Held for the grace period: asyncio keeps tasks only weakly, so a leaked task that
    # nothing references (waiting on a future only it holds) could be garbage-collected
    # meanwhile and pass for one that ended.
    held = set() if loop.is_closed() else asyncio.all_tasks(loop)
    deadline = time.monotonic() + LEAK_GRACE_S
    while (found := leftovers(before, loop)) and time.monotonic() < deadline:
        if loop.is_closed() or loop.is_running():
            time.sleep(LEAK_POLL_S)
        else:
            loop.run_until_complete(asyncio.sleep(LEAK_POLL_S))
    held.clear()
    if found:
        pytest.fail(
            f"{request.node.nodeid} left behind (still there {LEAK_GRACE_S:g} s after its "
            "fixtures were torn down):\n  " + "\n  ".join(found),
            pytrace=False,
        )
