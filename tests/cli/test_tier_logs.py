"""A real local tier process under ``--log-format json``: every line it writes is one
JSON object with the keys, and its events (start, a GPU down then up, stop) are there,
each once."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from cli.launcher import resolve_ports
from common.basics.redis_embed import EmbeddedRedis
from tests.cli.procs import CliProcess
from tests.conftest import small_fleet_spec

KEYS = ("timestamp", "level", "logger", "message")


def wait_for(proc: CliProcess, event: str, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.popen.poll() is None, proc.stderr.read_text()
        for line in proc.lines():
            if line.get("event") == event:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no {event} line in {proc.stderr.read_text()}")


def test_a_tier_writes_only_json_lines_with_its_events(
    tmp_path: Path, redis_server: EmbeddedRedis, launch: Callable[[list[str], str], CliProcess]
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

    lines = local.lines(strict=True)  # every line parsed as JSON, or this raised
    assert lines and all(all(key in line for key in KEYS) for line in lines)
    events = [line.get("event") for line in lines]
    for event in ("tier_started", "child_down", "child_up", "tier_stopping", "tier_stopped"):
        assert events.count(event) == 1, (event, events)
    assert local.stdout.read_text() == ""  # where it listens is a log line now
    assert not any(line["level"] == "debug" for line in lines)
