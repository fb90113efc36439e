"""Operations under load: SIGTERM drains a tier without losing a request; recent traces."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from cli.launcher import Fleet
from tests.client import LoadLoop, V2Client, region_of
from tests.conftest import small_fleet_spec

DUBLIN = ("x-meridian-client-geo", "53.35,-6.26")


def spec() -> dict[str, Any]:
    fleet_spec = small_fleet_spec(regions=2, zones=1, gpus=1)
    fleet_spec["global"]["ops_listen"] = "127.0.0.1:0"
    return fleet_spec


def test_sigterm_to_a_region_under_load_loses_no_request(
    fleet_factory: Callable[..., Fleet],
) -> None:
    fleet = fleet_factory(spec())
    with LoadLoop(fleet.global_address, [DUBLIN], clients=6, max_tokens=16) as load:
        time.sleep(1.0)
        assert {region_of(s.route) for s in load.since(0) if s.route} == {"eu-west"}
        stopped = time.monotonic()
        # Stops accepting, answers NOT_SERVING (the global moves away at once), lets the
        # requests in flight finish, then exits.
        fleet.processes["regional-eu-west"].stop(signal.SIGTERM)
        time.sleep(1.5)
        after = load.since(stopped + 0.2)
    assert load.failures() == []
    assert after and {region_of(s.route) for s in after} == {"us-east"}


def test_recent_traces_are_served_by_the_ops_endpoint(
    fleet_factory: Callable[..., Fleet],
) -> None:
    fleet = fleet_factory(spec())
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = ("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")  # sampled
    with V2Client(fleet.global_address) as client:
        client.infer(metadata=[DUBLIN, traceparent])
    ops = fleet.topology.global_tier.ops
    assert ops is not None
    with urllib.request.urlopen(f"http://{ops.address}/api/traces?limit=10", timeout=5) as reply:
        body = json.loads(reply.read())
    traces = {t["trace_id"]: t for t in body["traces"]}
    assert trace_id in traces
    names = {span["name"] for span in traces[trace_id]["spans"]}
    assert len(names) >= 2  # the global's server span and its decision/attempt spans
