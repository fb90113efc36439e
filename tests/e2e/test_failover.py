"""Failover when a tier process dies: no failed request once the failure is known."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from cli.launcher import Fleet
from common.request.v2 import generate_request
from tests.client import V2Client, expect_code, region_of, streamed_tokens, zone_of
from tests.conftest import small_fleet_spec
from tests.until import wait_until

NEAR_US_EAST_1A = ("x-meridian-client-geo", "39.03,-77.47")
DUBLIN = ("x-meridian-client-geo", "53.35,-6.26")


def routes(client: V2Client, n: int, metadata: list[tuple[str, str]]) -> list[str]:
    """Send ``n`` requests one after another; any failure fails the test."""
    return [client.infer(f"request {i}", 3, metadata=metadata).route for i in range(n)]


def test_zone_failover_and_return(fleet_factory: Callable[[dict[str, Any]], Fleet]) -> None:
    fleet = fleet_factory(small_fleet_spec(regions=1, zones=2, gpus=1))
    with V2Client(fleet.global_address) as client:
        assert {zone_of(r) for r in routes(client, 5, [NEAR_US_EAST_1A])} == {"us-east-1a"}

        fleet.kill("local-us-east-1a")
        after = routes(client, 20, [NEAR_US_EAST_1A])
        assert {zone_of(r) for r in after} == {"us-east-1b"}
        responses, route = client.stream(
            [generate_request("demo-llm", "stream during failover", 3)], metadata=[NEAR_US_EAST_1A]
        )
        assert streamed_tokens([r.infer_response for r in responses]) == 3
        assert zone_of(route) == "us-east-1b"

        fleet.restart("local-us-east-1a")
        wait_until(lambda: zone_of(client.infer(metadata=[NEAR_US_EAST_1A]).route) == "us-east-1a")


def test_region_failover_and_no_capacity_anywhere(
    fleet_factory: Callable[[dict[str, Any]], Fleet],
) -> None:
    fleet = fleet_factory(small_fleet_spec(regions=2, zones=1, gpus=1))
    with V2Client(fleet.global_address) as client:
        assert {region_of(r) for r in routes(client, 5, [DUBLIN])} == {"eu-west"}

        fleet.kill("regional-eu-west")
        assert {region_of(r) for r in routes(client, 20, [DUBLIN])} == {"us-east"}

        fleet.restart("regional-eu-west")
        wait_until(lambda: region_of(client.infer(metadata=[DUBLIN]).route) == "eu-west")

        # The region's process is up but every zone behind it is gone: the
        # regional tier answers UNAVAILABLE and the global spills to the next region.
        fleet.kill("local-eu-west-1a")
        assert {region_of(r) for r in routes(client, 10, [DUBLIN])} == {"us-east"}

        fleet.kill("regional-us-east")
        err = expect_code(grpc.StatusCode.UNAVAILABLE, client.infer, metadata=[DUBLIN])
        assert "demo-llm" in err.details()


def test_region_summary_says_no_gpu_and_global_skips_it(
    fleet_factory: Callable[[dict[str, Any]], Fleet],
) -> None:
    """Killing a region's GPUs shows up in its summary; the global routes around it
    without first trying the region."""
    fleet = fleet_factory(small_fleet_spec(regions=2, zones=1, gpus=1))
    with V2Client(fleet.global_address) as client:
        fleet.kill("worker-eu-west-1a")
        # Within a few summary cadences the global knows, and every request goes
        # straight to us-east with attempt 0.
        wait_until(lambda: region_of(client.infer(metadata=[DUBLIN]).route) == "us-east")
        time.sleep(3 * fleet.topology.summary_cadence_s)
        assert {region_of(r) for r in routes(client, 10, [DUBLIN])} == {"us-east"}
