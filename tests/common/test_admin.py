"""Admin API pieces without a fleet: routing index, admin keys, drain in pickers, reload diff."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from common.admin import AdminGuard, subtree_index, unapplied_settings
from common.auth import hash_key
from common.children import Child, ChildSet
from common.config import AuthConfig, Endpoint, TenantConfig, Topology, topology_from_mapping
from common.errors import RouteError
from common.geo import GeoPoint
from common.pick import PickRequest
from common.reload import reload_children
from global_lb.picker import RegionPicker
from regional_lb.server import drained
from sim.topology import one_zone_mapping

M = "m"


def topology() -> Topology:
    return topology_from_mapping(one_zone_mapping("redis://127.0.0.1:1/0", gpus=2, model=M))


def test_index_at_the_global_sends_everything_to_its_region() -> None:
    index = subtree_index(topology(), "global", "global")
    assert index == {
        "r": ("r", "region"),
        "r-1a": ("r", "zone"),
        "g0": ("r", "gpu"),
        "g1": ("r", "gpu"),
    }


def test_index_at_the_regional_sends_gpus_to_their_zone() -> None:
    assert subtree_index(topology(), "regional", "r") == {
        "r-1a": ("r-1a", "zone"),
        "g0": ("r-1a", "gpu"),
        "g1": ("r-1a", "gpu"),
    }
    assert subtree_index(topology(), "regional", "other") == {}


def test_index_at_the_local_tier_owns_its_gpus() -> None:
    assert subtree_index(topology(), "local", "r-1a") == {"g0": ("g0", "gpu"), "g1": ("g1", "gpu")}


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def guard() -> AdminGuard:
    tenant = TenantConfig(id="acme", key_hashes=frozenset({hash_key("mk_tenant")}))
    return AdminGuard(
        AuthConfig(
            enabled=True, tenants=(tenant,), admin_key_hashes=frozenset({hash_key("mk_admin")})
        )
    )


@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        ([], grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", "mk_admin")], grpc.StatusCode.UNAUTHENTICATED),
        (bearer("mk_other"), grpc.StatusCode.UNAUTHENTICATED),
        (bearer("mk_tenant"), grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_admin_guard_refuses(metadata: list[tuple[str, str]], code: grpc.StatusCode) -> None:
    with pytest.raises(RouteError) as err:
        guard().check(metadata)
    assert err.value.code == code


def test_admin_guard_admits_an_admin_key_and_everyone_when_auth_is_off() -> None:
    guard().check(bearer("mk_admin"))
    AdminGuard(AuthConfig(enabled=False)).check([])


def zone(name: str, lat: float = 0.0) -> Child:
    return Child(
        name=name,
        endpoint=Endpoint("127.0.0.1", 1),
        models=frozenset({M}),
        location=GeoPoint(lat, 0),
    )


def test_a_drained_region_is_skipped_and_named_when_nothing_is_left() -> None:
    near, far = zone("near"), zone("far", 40.0)
    children = ChildSet([near, far], probe_interval_s=1, summary_ttl_s=1.5, kind="region")
    picker = RegionPicker(GeoPoint(0, 0), 1.5)
    request = PickRequest(M, "", GeoPoint(0, 0), None, "standard")
    assert picker.rank(request, [near, far], 0.0)[0] is near
    changes: list[str] = []
    children.add_listener(lambda: changes.append("changed"))
    children.set_drained(near, True)
    assert changes == ["changed"] and near.healthy  # draining is not a failure
    assert picker.rank(request, [near, far], 0.0) == [far]
    children.set_drained(far, True)
    assert picker.rank(request, [near, far], 0.0) == []
    assert "near (drained); far (drained)" in children.nothing_healthy(M)
    children.set_drained(near, False)
    assert picker.rank(request, [near, far], 0.0) == [near]


def test_a_drained_zone_summary_keeps_its_gpus_but_no_capacity() -> None:
    from common.gen.meridian.v1 import capacity_pb2

    entry = capacity_pb2.ModelCapacity(
        model=M, healthy_gpus=3, total_gpus=4, total_slots=48, free_slots=40
    )
    out = drained(capacity_pb2.CapacitySummary(source_id="s", sequence=7, models=[entry]))
    assert (out.sequence, out.models[0].total_gpus, out.models[0].healthy_gpus) == (7, 4, 0)
    assert out.models[0].total_slots == out.models[0].free_slots == 0


def test_unapplied_settings_name_what_a_running_tier_leaves_alone() -> None:
    old = topology()
    assert unapplied_settings(old, old, "local", "r-1a") == []
    moved = dataclasses.replace(old, redis_url="redis://elsewhere:6379/0")
    assert unapplied_settings(old, moved, "global", "global") == ["redis_url (restart to apply)"]
    assert unapplied_settings(old, old, "local", "gone") == [
        "gone itself is gone from the topology: stop this process"
    ]


async def test_reload_adds_down_retires_after_in_flight_and_updates_models() -> None:
    a, b = zone("a"), zone("b")
    children = ChildSet([a, b], probe_interval_s=1, summary_ttl_s=1.5, probe=False)
    await children.start()
    try:
        b.outstanding_requests = 1  # a call in flight
        wider = dataclasses.replace(zone("a"), models=frozenset({M, "n"}))
        report = await reload_children(children, [wider, zone("c")])
        assert (list(report.added), list(report.removed)) == (["c"], ["b"])
        assert list(report.changed) == ["a: models ['m'] -> ['m', 'n']"]
        assert a.models == {M, "n"} and not children.by_name["c"].healthy
        assert b.drained and children.leaving("b")
        await asyncio.sleep(0.1)
        assert "b" in children.by_name  # still finishing its call
        b.outstanding_requests = 0
        for _ in range(50):
            if "b" not in children.by_name:
                break
            await asyncio.sleep(0.02)
        assert [c.name for c in children] == ["a", "c"] and not children.leaving("b")
    finally:
        await children.stop()
