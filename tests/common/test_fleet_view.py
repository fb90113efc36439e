"""The fleet merged from each tier's /api/state answer (no processes: canned answers)."""

from __future__ import annotations

from typing import Any

from common.children import ChildSet
from common.config import Endpoint, topology_from_mapping
from common.fleet_view import Fetched, FleetView, merge_fleet, ops_targets, reachable_address
from common.ops import OpsServer, TierMetrics
from tests.conftest import small_fleet_spec

TOPOLOGY = topology_from_mapping(small_fleet_spec(regions=2, zones=1, gpus=2))
US, EU = TOPOLOGY.regions
US_ZONE, EU_ZONE = US.zones[0], EU.zones[0]


def child(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "healthy": True, "outstanding_requests": 0, "last_error": "", **extra}


def summary(slots: int, busy: int, queued: int) -> dict[str, Any]:
    # MessageToDict's names; a zero field is left out, as protobuf JSON does.
    model: dict[str, Any] = {"model": "demo-llm", "totalSlots": slots, "healthyGpus": 2}
    if busy:
        model["busySlots"] = busy
    if queued:
        model["queuedRequests"] = queued
    return {"models": [model]}


def local_state(zone: str, gpus: list[dict[str, Any]]) -> Fetched:
    queue = {"critical": 0, "standard": 2, "sheddable": 1}
    return Fetched({"tier": "local", "name": zone, "ready": True, "children": gpus, "queue": queue})


def own_state() -> dict[str, Any]:
    return {
        "name": "global",
        "ready": True,
        "children": [
            child(US.name, summary=summary(32, 8, 3), outstanding_requests=8),
            child(EU.name, healthy=False, last_error="connection refused"),
        ],
    }


def test_every_gpu_with_its_load_and_state() -> None:
    gpu0, gpu1 = (g.name for g in US_ZONE.gpus)
    fetched = {
        f"regional {US.name}": Fetched(
            {"ready": True, "children": [child(US_ZONE.name, summary=summary(32, 8, 3))]}
        ),
        f"local {US_ZONE.name}": local_state(
            US_ZONE.name,
            [
                child(
                    gpu0,
                    hardware="H100",
                    slots=16,
                    outstanding_requests=12,
                    weight=2.0,
                    reported={"running": 12, "waiting": 4, "kv_cache_usage": 0.5},
                ),
                child(gpu1, hardware="A100", slots=16, ejected=True, reported=None),
            ],
        ),
    }
    fleet = merge_fleet(TOPOLOGY, own_state(), fetched)
    us = fleet["regions"][0]
    assert (us["name"], us["reachable"], us["healthy"]) == (US.name, True, True)
    assert us["utilisation"] == 0.25 and us["queued"] == 3
    zone = us["zones"][0]
    assert zone["tier_queued"] == 3 and zone["utilisation"] == 0.25
    first, second = zone["gpus"]
    assert first["state"] == "ok" and first["utilisation"] == 0.75 and first["weight"] == 2.0
    assert (first["running"], first["waiting"], first["kv_cache_usage"]) == (12, 4, 0.5)
    assert second["state"] == "ejected" and second["running"] is None
    totals = fleet["totals"]
    assert totals["gpus"] == 4 and totals["gpus_ok"] == 1
    assert totals["queued"] == 4 + 3  # what the GPU reports plus the local tier's queue


def test_a_tier_that_does_not_answer_is_unreachable_and_its_gpus_unknown() -> None:
    fetched = {
        f"regional {EU.name}": Fetched(None, "TimeoutError"),
        f"local {EU_ZONE.name}": Fetched(None, "ClientConnectorError: refused"),
    }
    fleet = merge_fleet(TOPOLOGY, own_state(), fetched)
    eu = fleet["regions"][1]
    assert (eu["reachable"], eu["healthy"], eu["error"]) == (False, False, "TimeoutError")
    assert eu["last_error"] == "connection refused"
    zone = eu["zones"][0]
    assert zone["reachable"] is False and zone["tier_queued"] is None
    assert [g["state"] for g in zone["gpus"]] == ["unknown", "unknown"]
    assert [g["name"] for g in zone["gpus"]] == [g.name for g in EU_ZONE.gpus]


def test_a_drained_gpu_and_zone() -> None:
    gpu0, gpu1 = (g.name for g in US_ZONE.gpus)
    fetched = {
        f"regional {US.name}": Fetched(
            {"ready": True, "children": [child(US_ZONE.name, drained=True)]}
        ),
        f"local {US_ZONE.name}": local_state(
            US_ZONE.name, [child(gpu0, drained=True), child(gpu1, healthy=False)]
        ),
    }
    zone = merge_fleet(TOPOLOGY, own_state(), fetched)["regions"][0]["zones"][0]
    assert zone["drained"] is True
    assert [g["state"] for g in zone["gpus"]] == ["drained", "down"]


def test_targets_are_every_inner_tier_with_ops_reached_over_loopback() -> None:
    targets = ops_targets(TOPOLOGY)
    assert [t.label for t in targets] == [
        f"regional {US.name}",
        f"local {US_ZONE.name}",
        f"regional {EU.name}",
        f"local {EU_ZONE.name}",
    ]
    assert reachable_address(Endpoint("0.0.0.0", 9000)) == "127.0.0.1:9000"
    assert reachable_address(Endpoint("::", 9000)) == "[::1]:9000"
    assert reachable_address(Endpoint("10.0.0.5", 9000)) == "10.0.0.5:9000"


def test_a_reloaded_topology_is_followed() -> None:
    ops = OpsServer(
        Endpoint("127.0.0.1", 0),
        "global",
        TierMetrics("global", ChildSet((), probe_interval_s=1, summary_ttl_s=1)),
    )
    view = FleetView(TOPOLOGY, ops)
    assert len(view.targets) == 4
    one_region = topology_from_mapping(small_fleet_spec(regions=1, zones=1, gpus=1))
    view.follow(one_region)
    assert [t.label for t in view.targets] == [f"regional {US.name}", f"local {US_ZONE.name}"]
    assert view.topology is one_region
