"""The embedded Redis: an fsync'd append-only file when given a data directory (nothing on
disk otherwise), and a redis-server that dies with the process that started it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from common.basics.redis_embed import EmbeddedRedis

STARTER = """
import sys, time
from common.basics.redis_embed import EmbeddedRedis
server = EmbeddedRedis()
server.start()
print(server.port, server.process.pid, flush=True)
time.sleep(60)
"""


def answers(port: int) -> bool:
    """Something listens on the port (a plain connect: redis-py would retry for seconds)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.3).close()
    except OSError:
        return False
    return True


def test_sigkill_loses_no_acknowledged_write_with_a_data_dir(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path / "redis")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        for i in range(500):
            client.xadd("s", {"i": str(i)})
        server.kill()  # the moment after the last answer
        server.start()
        assert client.xlen("s") == 500
        config = client.config_get("append*")
        assert (config["appendonly"], config["appendfsync"]) == ("yes", "always")
        client.close()
    finally:
        server.close()
    # A second `meridian up` on the same run directory: a new Redis, the same records.
    again = EmbeddedRedis(data_dir=tmp_path / "redis")
    again.start()
    try:
        client = redis.Redis.from_url(again.url)
        assert client.xlen("s") == 500
        client.close()
    finally:
        again.close()
    assert (tmp_path / "redis" / "redis.log").exists()


def test_without_a_data_dir_a_restart_keeps_nothing() -> None:
    server = EmbeddedRedis()
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        server.stop()
        server.start()
        assert client.get("k") is None
        client.close()
    finally:
        server.close()


def test_redis_server_dies_with_the_process_that_started_it() -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert starter.stdout is not None
        port, pid = map(int, starter.stdout.readline().split())
        assert answers(port)
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 5
        while answers(port):
            assert time.monotonic() < deadline, f"redis-server {pid} outlived its parent"
            time.sleep(0.05)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait(10)
        starter.stdout.close()  # type: ignore[union-attr]


def test_started_from_another_thread_it_outlives_that_thread() -> None:
    """PR_SET_PDEATHSIG fires when the forking *thread* exits, so it is not asked for there."""
    server = EmbeddedRedis()
    starting = threading.Thread(target=server.start)
    starting.start()
    starting.join()
    try:
        time.sleep(0.3)
        assert answers(server.port)
    finally:
        server.close()


@pytest.mark.parametrize("data_dir", [None, "redis"])
def test_a_taken_port_is_reported(tmp_path: Path, data_dir: str | None) -> None:
    first = EmbeddedRedis()
    first.start()
    try:
        second = EmbeddedRedis(first.port, data_dir=tmp_path / data_dir if data_dir else None)
        with pytest.raises(RuntimeError, match=f"port {first.port} taken"):
            second.start()
        second.close()
    finally:
        first.close()
