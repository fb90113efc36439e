"""The multi-host fleet, shared by the partition tests; skipped, saying why, where the
harness cannot run (it needs root and iproute2's network namespaces)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multihost.fleet import FleetShape, MultiHostFleet
from tests.multihost.hosts import unavailable

# Short enough to watch the whole ramp inside a test; the benchmark keeps the default.
TEST_FAILBACK_WINDOW_S = 5.0


@pytest.fixture(scope="session")
def netns_ok() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"multi-host harness cannot run here: {reason}")


@pytest.fixture(scope="module")
def multihost_fleet(
    netns_ok: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiHostFleet]:
    """2 regions (us-east, eu-west) x 1 zone x 2 GPUs, each site on hosts of its own."""
    fleet = MultiHostFleet(
        tmp_path_factory.mktemp("multihost"),
        FleetShape(regions=2, zones=1, gpus=2, failback_window_s=TEST_FAILBACK_WINDOW_S),
    )
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
