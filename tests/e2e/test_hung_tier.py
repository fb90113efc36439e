"""A hung tier (SIGSTOP: alive, connections open, no RST) under load: keepalive finds it.

The regional tier's channel to a stopped local tier stops getting PING answers and
is closed within keepalive's time + timeout (2 s): the calls on it fail UNAVAILABLE
and, having sent nothing back, go to the other zone; the zone's health Watch breaks,
so it is marked down and new requests go to the other zone at once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc

from cli.launcher import Fleet
from tests.client import LoadLoop, V2Client, zone_of
from tests.conftest import small_fleet_spec

NEAR_US_EAST_1A = ("x-meridian-client-geo", "39.03,-77.47")
# Keepalive between tiers: a ping after 1 s of silence, 1 s for its answer.
DETECTED_S = 2.0


def test_a_stopped_local_tier_is_marked_down_and_its_requests_fail_over(
    fleet_factory: Callable[[dict[str, Any]], Fleet],
) -> None:
    fleet = fleet_factory(small_fleet_spec(regions=1, zones=2, gpus=1))
    hung = fleet.processes["local-us-east-1a"].process
    assert hung is not None
    with V2Client(fleet.global_address) as client:
        assert zone_of(client.infer(metadata=[NEAR_US_EAST_1A]).route) == "us-east-1a"
    try:
        with LoadLoop(fleet.global_address, [NEAR_US_EAST_1A], clients=4) as load:
            time.sleep(0.5)
            os.kill(hung.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            time.sleep(DETECTED_S + 3.0)
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    # Nothing failed: the calls caught on the stopped tier were failed over
    # (their 10 s deadline would have failed them).
    assert not load.failures(), load.failures()[:3]
    during = [s for s in load.since(stopped - 0.5) if s.started < stopped + DETECTED_S + 3.0]
    assert max(s.ended - s.started for s in during) < DETECTED_S + 1.5
    # Found within ~2-3 s: from then on every request goes to the other zone at once.
    after = [s for s in load.since(stopped + DETECTED_S + 1.0)]
    assert after, "no request ran after the tier was found down"
    assert {zone_of(s.route) for s in after} == {"us-east-1b"}
    assert max(s.ended - s.started for s in after) < 1.0
    assert all(s.code == grpc.StatusCode.OK for s in after)
