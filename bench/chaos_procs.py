"""The fleet's processes as /proc shows them: who they are, their state, how to restart them.

``children(pid)`` finds the processes a launcher started and the role each plays in the
fleet (``worker-<zone>``, ``local-<zone>``, ``regional-<region>``, ``global``, ``redis``),
from its command line. Redis rewrites its /proc cmdline to a title, so the command that
starts it again is rebuilt from its binary and CONFIG GET (``redis_command``). A pid is
trusted only while its cmdline is the one recorded (``still``): never signal a reused pid.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import redis


@dataclass
class Proc:
    """One process of the fleet: how to find it, signal it and start it again."""

    role: str
    pid: int
    argv: list[str]  # its /proc cmdline, which tells it from a process that reused its pid
    cwd: str
    command: list[str]  # how to start it again (Redis rewrites its cmdline: see redis_command)
    popen: subprocess.Popen[bytes] | None = None  # set when the bench started it


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from /proc, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running or stopped, not gone and not a zombie waiting to be reaped."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def argv_of(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None


def still(proc: Proc) -> bool:
    """``proc`` is alive and still the process we know (its pid was not reused)."""
    return alive(proc.pid) and argv_of(proc.pid) == proc.argv


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (0 when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# What the embedded Redis may have been started with (the launcher's, or a durable one).
REDIS_OPTIONS = (
    "port",
    "bind",
    "dir",
    "save",
    "appendonly",
    "appendfsync",
    "appendfilename",
    "appenddirname",
    "dbfilename",
    "aof-use-rdb-preamble",
    "protected-mode",
    "requirepass",
    "aclfile",
    "maxmemory",
    "maxmemory-policy",
)


def redis_command(pid: int, url: str) -> list[str]:
    """The command line that starts this Redis again as it runs now.

    redis-server rewrites its /proc cmdline to a title ("redis-server 127.0.0.1:port"), so
    the binary comes from /proc/<pid>/exe and the options from CONFIG GET.
    """
    client = redis.Redis.from_url(url, socket_timeout=2.0, decode_responses=True)
    try:
        args = [os.readlink(f"/proc/{pid}/exe")]
        for option in REDIS_OPTIONS:
            for key, value in client.config_get(option).items():
                if key == option and not (option == "requirepass" and not value):
                    args += [f"--{option}", str(value)]
        return args
    finally:
        client.close()


def role_of(argv: list[str]) -> str | None:
    """The fleet role a command line plays, None for anything else."""
    if argv and argv[0] and argv[0].split()[0].endswith("redis-server"):
        return "redis"
    if "cli.main" not in argv:
        return None
    rest = argv[argv.index("cli.main") + 1 :]
    command = rest[0] if rest else ""

    def value(flag: str) -> str:
        return rest[rest.index(flag) + 1] if flag in rest else "?"

    if command == "worker":
        return f"worker-{value('--zone')}"
    if command == "local":
        return f"local-{value('--zone')}"
    if command == "regional":
        return f"regional-{value('--region')}"
    return "global" if command == "global" else None


def children(root: int) -> dict[str, Proc]:
    """The live descendants of ``root`` that play a fleet role, by role (the nearest one
    when two do: a launcher may start a process through a wrapper)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            if stat[0] not in ("Z", "X"):
                parents.setdefault(stat[1], []).append(int(entry.name))
    found: dict[str, Proc] = {}
    level = parents.get(root, [])
    while level:
        for pid in level:
            argv = argv_of(pid)
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            role = role_of(argv) if argv is not None else None
            if argv is not None and role is not None and role not in found:
                found[role] = Proc(role, pid, argv, cwd, argv)
        level = [child for pid in level for child in parents.get(pid, [])]
    return found
