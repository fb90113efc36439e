"""Shared fixtures: a real embedded Redis and real multi-process fleets on loopback."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.launcher import DEMO_FLEET, Fleet
from common.basics.redis_embed import EmbeddedRedis

# Emulated GPUs run 20x faster than real time in tests.
TEST_TIME_SCALE = 0.05


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    server.start()
    try:
        yield server
    finally:
        server.close()


def demo_fleet_spec() -> dict[str, Any]:
    """The demo fleet, moved off the fixed port 8001 so tests never clash with `make up`."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["global"]["listen"] = "127.0.0.1:0"
    spec["global"]["ops_listen"] = "127.0.0.1:0"  # and off the demo's fixed ops port 8002
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


@pytest.fixture(scope="session")
def demo_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The whole demo fleet (3 regions x 2 zones x 4 GPUs), shared by read-only tests."""
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
        for fleet in fleets:
            fleet.stop()
