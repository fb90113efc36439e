"""A real local tier process under ``--log-format json``: every line it writes is one
JSON object with the keys, and its events (start, a GPU down then up, stop) are there,
each once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.launcher import resolve_ports
from common.basics.redis_embed import EmbeddedRedis
from tests.conftest import small_fleet_spec

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("timestamp", "level", "logger", "message")


class Process:
    """A ``python -m cli.main`` process, its stdout and stderr in files of their own."""

    def __init__(self, argv: list[str], out: Path) -> None:
        self.stdout, self.stderr = out.with_suffix(".out"), out.with_suffix(".err")
        with self.stdout.open("wb") as o, self.stderr.open("wb") as e:
            cmd = [sys.executable, "-m", "cli.main", *argv]
            self.popen = subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=e)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stderr.read_text().splitlines()]

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[[list[str], str], Process]]:
    started: list[Process] = []

    def start(argv: list[str], name: str) -> Process:
        started.append(Process(argv, tmp_path / name))
        return started[-1]

    try:
        yield start
    finally:
        for proc in reversed(started):
            proc.stop()


def wait_for(proc: Process, event: str, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.popen.poll() is None, proc.stderr.read_text()
        for line in proc.lines():
            if line.get("event") == event:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no {event} line in {proc.stderr.read_text()}")


def test_a_tier_writes_only_json_lines_with_its_events(
    tmp_path: Path, redis_server: EmbeddedRedis, launch: Callable[[list[str], str], Process]
) -> None:
    spec = resolve_ports(small_fleet_spec(regions=1, zones=1, gpus=1))
    spec["redis_url"] = redis_server.url
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(spec))
    region = spec["regions"][0]
    where = ["--config", str(config), "--region", region["name"]]
    where += ["--zone", region["zones"][0]["name"]]
    gpu = region["zones"][0]["gpus"][0]["name"]

    local = launch(["local", *where, "--log-format", "json"], "local")
    started = wait_for(local, "tier_started")
    assert started["tier"] == "local" and started["address"].startswith("127.0.0.1:")
    down = wait_for(local, "child_down")  # its GPU server is not running yet
    assert down["child"] == gpu and down["level"] == "warning"
    worker = launch(["worker", *where], "worker")
    up = wait_for(local, "child_up")
    assert up["child"] == gpu and up["level"] == "info"
    assert local.stop() == 0
    worker.stop()

    lines = local.lines()  # every line parsed as JSON, or this raised
    assert lines and all(all(key in line for key in KEYS) for line in lines)
    events = [line.get("event") for line in lines]
    for event in ("tier_started", "child_down", "child_up", "tier_stopping", "tier_stopped"):
        assert events.count(event) == 1, (event, events)
    assert local.stdout.read_text() == ""  # where it listens is a log line now
    assert not any(line["level"] == "debug" for line in lines)
