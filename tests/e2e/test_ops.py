"""The ops HTTP of every tier: liveness, readiness, state and Prometheus metrics."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc

from cli.launcher import Fleet
from common.request.v2 import generate_request
from tests.client import V2Client, expect_code, streamed_tokens
from tests.common.observability.test_metrics import parse
from tests.conftest import small_fleet_spec
from tests.until import wait_until

REGION = "us-east"
ZONES = ("us-east-1a", "us-east-1b")


def ops_spec() -> dict[str, Any]:
    spec = small_fleet_spec(regions=1, zones=2, gpus=1)
    spec["global"]["ops_listen"] = "127.0.0.1:0"
    for region in spec["regions"]:
        region["ops_listen"] = "127.0.0.1:0"
        for zone in region["zones"]:
            zone["ops_listen"] = "127.0.0.1:0"
    return spec


def get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def requests_by_status(address: str, tier: str) -> dict[str, float]:
    status, text = get(address, "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for name, labels, value in parse(text):
        if name == "meridian_requests_total" and labels["tier"] == tier:
            out[labels["status"]] = out.get(labels["status"], 0.0) + value
    return out


def addresses(fleet: Fleet) -> dict[str, str]:
    topo = fleet.topology
    region = topo.region(REGION)
    ops = {"global": topo.global_tier.ops, "regional": region.ops}
    ops.update({z.name: z.ops for z in region.zones})
    out = {}
    for name, endpoint in ops.items():
        assert endpoint is not None
        out[name] = endpoint.address
    return out


def test_ops_endpoints_on_every_tier(fleet_factory: Callable[[dict[str, Any]], Fleet]) -> None:
    fleet = fleet_factory(ops_spec())
    ops = addresses(fleet)
    for address in ops.values():
        assert get(address, "/healthz")[0] == 200
        assert get(address, "/readyz")[0] == 200

    before = requests_by_status(ops["global"], "global")
    with V2Client(fleet.global_address) as client:
        for i in range(5):
            client.infer(f"request {i}", 3)
        responses, _ = client.stream([generate_request("demo-llm", "a stream", 3)])
        assert streamed_tokens([r.infer_response for r in responses]) == 3
        expect_code(
            grpc.StatusCode.NOT_FOUND,
            lambda: client.infer(model="no-such-model"),
        )

    def moved() -> dict[str, float]:
        after = requests_by_status(ops["global"], "global")
        return {s: after.get(s, 0.0) - before.get(s, 0.0) for s in after}

    # An abort reaches the client before the call's metrics are written: wait for them.
    expected = {"OK": 6.0, "NOT_FOUND": 1.0}
    wait_until(lambda: moved() == expected, 5.0, f"metrics {expected}")

    samples = parse(get(ops["global"], "/metrics")[1])
    ok = [
        v
        for n, labels, v in samples
        if n == "meridian_request_duration_seconds_count"
        and labels == {"tier": "global", "model": "demo-llm", "status": "OK", "tenant": "-"}
    ]
    assert ok == [6.0]
    health = {labels["child"]: v for n, labels, v in samples if n == "meridian_child_healthy"}
    assert health == {REGION: 1.0}

    local = {n for n, _, _ in parse(get(ops[ZONES[0]], "/metrics")[1])}
    assert {"meridian_queue_depth", "meridian_ejections_total"} <= local
    assert "meridian_requests_total" in local

    def regional_state() -> dict[str, Any]:
        state: dict[str, Any] = json.loads(get(ops["regional"], "/api/state")[1])
        return state

    wait_until(lambda: all(c["summary_age_s"] is not None for c in regional_state()["children"]))
    state = regional_state()
    assert state["tier"] == "regional" and state["name"] == REGION
    children = {c["name"]: c for c in state["children"]}
    assert set(children) == set(ZONES)
    for child in children.values():
        assert child["healthy"] is True
        assert 0 <= child["summary_age_s"] < 10
        assert child["summary"]["models"][0]["model"] == "demo-llm"


def test_readiness_follows_the_children(fleet_factory: Callable[[dict[str, Any]], Fleet]) -> None:
    fleet = fleet_factory(ops_spec())
    regional = addresses(fleet)["regional"]
    assert get(regional, "/readyz")[0] == 200

    for zone in ZONES:
        fleet.kill(f"local-{zone}")
    wait_until(lambda: get(regional, "/readyz")[0] == 503)
    assert get(regional, "/healthz")[0] == 200
    state = json.loads(get(regional, "/api/state")[1])
    assert [c["healthy"] for c in state["children"]] == [False, False]

    for zone in ZONES:
        fleet.restart(f"local-{zone}")
    wait_until(lambda: get(regional, "/readyz")[0] == 200)
