"""The fleet merged from each tier's /api/state answer (canned answers), and fetched
live from stand-in tiers that are dead, slow or answer garbage."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.config.node import Endpoint
from common.config.topology import topology_from_mapping
from common.observability import tracing as tm
from common.observability.tier_metrics import TierMetrics
from common.operations.fleet_merge import Fetched, merge_fleet
from common.operations.fleet_view import FleetView, ops_targets, reachable_address
from common.operations.ops_http import OpsServer
from common.request.children import ChildSet
from tests.common.observability.test_trace_view import span
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


def test_targets_are_every_inner_tier_with_ops_a_wildcard_bind_over_loopback() -> None:
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
    view = FleetView(TOPOLOGY)
    assert len(view.targets) == 4
    one_region = topology_from_mapping(small_fleet_spec(regions=1, zones=1, gpus=1))
    view.follow(one_region)
    assert [t.label for t in view.targets] == [f"regional {US.name}", f"local {US_ZONE.name}"]
    assert view.topology is one_region


def test_odd_fields_from_a_tier_read_as_unknown_not_as_a_crash() -> None:
    gpu0, gpu1 = (g.name for g in US_ZONE.gpus)
    fetched = {
        f"regional {US.name}": Fetched(
            {
                "ready": "yes",
                "children": [
                    "not a child",
                    {"healthy": True},  # no name
                    child(US_ZONE.name, healthy="yes", outstanding_requests="7", summary="x"),
                ],
            }
        ),
        f"local {US_ZONE.name}": Fetched(
            {
                "children": [
                    child(gpu0, slots="many", outstanding_requests=None, reported=[1, 2]),
                    child(gpu1, hardware=5, weight=float("nan"), last_error=["x"]),
                ],
                "queue": {"standard": float("inf")},
            }
        ),
    }
    fleet = merge_fleet(TOPOLOGY, own_state(), fetched)
    us = fleet["regions"][0]
    zone = us["zones"][0]
    assert us["ready"] is None and zone["healthy"] is None and zone["outstanding"] is None
    assert zone["utilisation"] is None and zone["tier_queued"] is None
    first, second = zone["gpus"]
    assert first["state"] == "ok" and first["slots"] == US_ZONE.gpus[0].max_concurrency
    assert (first["outstanding"], first["running"], first["kv_cache_usage"]) == (0, None, None)
    assert second["hardware"] == US_ZONE.gpus[1].hardware and second["last_error"] == ""
    assert "weight" not in second
    assert fleet["totals"]["gpus_ok"] == 2


async def test_shared_answer_forgets_a_failure_at_once() -> None:
    view = FleetView(TOPOLOGY, max_age_s=60)
    calls: list[int] = []

    async def flaky() -> dict[str, Any]:
        calls.append(len(calls))
        await asyncio.sleep(0)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return {"n": len(calls)}

    # Two callers share the failing computation; both see its error.
    first = await asyncio.gather(
        view._shared_answer("k", flaky), view._shared_answer("k", flaky), return_exceptions=True
    )
    assert [type(r) for r in first] == [RuntimeError, RuntimeError] and len(calls) == 1
    await asyncio.sleep(0)  # the done callback runs
    # Well inside max_age_s the next caller starts afresh, and that answer is shared.
    assert await view._shared_answer("k", flaky) == {"n": 2}
    assert await view._shared_answer("k", flaky) == {"n": 2}
    assert len(calls) == 2


def global_ops() -> OpsServer:
    return OpsServer(
        Endpoint("127.0.0.1", 0),
        "global",
        TierMetrics("global", ChildSet((), probe_interval_s=1, summary_ttl_s=1)),
    )


class InnerTier:
    """A stand-in for one inner tier's ops HTTP: answers ``/api/state`` and
    ``/api/traces`` with ``behaviour`` and counts the calls."""

    def __init__(self, behaviour: str, body: dict[str, Any] | None = None) -> None:
        self.behaviour = behaviour  # "ok", "slow" (past the timeout), "garbage"
        self.body = body or {}
        self.calls = 0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/state", self._answer)
        app.router.add_get("/api/traces", self._answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _answer(self, request: web.Request) -> web.Response:
        self.calls += 1
        await asyncio.sleep(0.05)  # long enough for a second caller to arrive
        if self.behaviour == "slow":
            await self.release.wait()
        if self.behaviour == "garbage":
            return web.Response(text='{"children": [', content_type="application/json")
        return web.json_response(self.body)


def dead_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@contextlib.asynccontextmanager
async def fleet_view(
    tiers: dict[str, InnerTier | None], ops: OpsServer
) -> AsyncIterator[tuple[TestClient[web.Request, web.Application], FleetView]]:
    """The global's fleet endpoints over ``tiers`` (by target label; None: nothing
    listening), served by an aiohttp test server; everything stopped at the end."""
    spec = small_fleet_spec(regions=2, zones=1, gpus=2)
    ports = {}
    for label, tier in tiers.items():
        if tier is not None:
            await tier.start()
        ports[label] = dead_port() if tier is None else tier.port
    for region in spec["regions"]:
        region["ops_listen"] = f"127.0.0.1:{ports['regional ' + region['name']]}"
        for zone in region["zones"]:
            zone["ops_listen"] = f"127.0.0.1:{ports['local ' + zone['name']]}"
    # Answers stay shared for 5 s: the default 0.5 s is as long as the slow tier's
    # timeout, so on a loaded machine a second viewer arriving a little late would
    # start a second fetch (staleness has its own test).
    view = FleetView(topology_from_mapping(spec), timeout_s=0.5, max_age_s=5)
    app = web.Application()
    view.install(app, ops)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield client, view
    finally:
        await client.close()
        for tier in tiers.values():
            if tier is not None:
                await tier.stop()


async def test_live_fetch_dead_slow_and_garbage_tiers_and_one_fetch_for_two_viewers() -> None:
    gpu = EU_ZONE.gpus[0].name
    good = InnerTier("ok", {"ready": True, "children": [child(gpu, slots=16)], "queue": {}})
    slow, garbage = InnerTier("slow"), InnerTier("garbage")
    tiers = {
        f"regional {US.name}": None,
        f"local {US_ZONE.name}": slow,
        f"regional {EU.name}": garbage,
        f"local {EU_ZONE.name}": good,
    }
    async with fleet_view(tiers, global_ops()) as (client, _):
        started = time.monotonic()
        replies = await asyncio.gather(client.get("/api/fleet"), client.get("/api/fleet"))
        assert time.monotonic() - started < 2  # the slow tier cost one timeout, no more
        first, second = [await r.json() for r in replies]
        assert all(r.status == 200 for r in replies) and first == second
        assert (good.calls, slow.calls, garbage.calls) == (1, 1, 1)
    us, eu = first["regions"]
    assert us["reachable"] is False and "ClientConnectorError" in us["error"]
    assert us["zones"][0]["reachable"] is False and "Timeout" in us["zones"][0]["error"]
    assert eu["reachable"] is False and "JSONDecodeError" in eu["error"]
    zone = eu["zones"][0]
    assert zone["reachable"] is True and zone["gpus"][0]["state"] == "ok"
    assert [g["state"] for g in us["zones"][0]["gpus"]] == ["unknown", "unknown"]


def one_trace(trace_id: str, tier: str, region: str, zone: str, start_ms: float) -> dict[str, Any]:
    """What one tier keeps of a request routed to ``region``/``zone``."""
    sid = f"{tier[0]}{trace_id[:4]}"
    attrs = {tm.TIER: tier, tm.REGION: region, tm.ZONE: zone}
    spans = [span(sid, None, "ModelInfer", start_ms, start_ms + 5, **attrs)]
    if tier == "global":
        spans.append(span(sid + "a", sid, f"ModelInfer {region}", start_ms, start_ms + 4))
        spans[-1]["attributes"][tm.CHILD] = region
    return {"trace_id": trace_id, "spans": spans}


async def test_a_trace_through_a_silent_tier_is_marked_incomplete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    to_eu, to_us = "e" * 32, "a" * 32
    eu = (EU.name, EU_ZONE.name)
    ops = global_ops()
    own = {
        "traces": [
            one_trace(to_eu, "global", *eu, 10),
            one_trace(to_us, "global", US.name, US_ZONE.name, 5),
        ]
    }
    monkeypatch.setattr(ops, "traces", lambda limit: copy.deepcopy(own))
    tiers = {
        f"regional {US.name}": None,
        f"local {US_ZONE.name}": InnerTier("ok", {"traces": "not a list"}),
        f"regional {EU.name}": InnerTier("ok", {"traces": [one_trace(to_eu, "regional", *eu, 11)]}),
        f"local {EU_ZONE.name}": InnerTier("ok", {"traces": [one_trace(to_eu, "local", *eu, 12)]}),
    }
    async with fleet_view(tiers, ops) as (client, _):
        reply = await client.get("/api/fleet/traces?limit=5")
        assert reply.status == 200
        traces = {t["trace_id"]: t for t in (await reply.json())["traces"]}
    assert traces[to_eu]["complete"] is True
    assert traces[to_eu]["tiers"] == ["global", "regional", "local"]
    assert traces[to_us]["complete"] is False and traces[to_us]["tiers"] == ["global"]
