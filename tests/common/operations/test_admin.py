"""Admin API pieces without a fleet: routing index, admin keys, drain in pickers, reload diff."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from cli.admin import admin_main
from common.basics.errors import RouteError
from common.basics.geo import GeoPoint
from common.basics.vocabulary import Priority
from common.config.access import AuthConfig, TenantConfig
from common.config.node import Endpoint
from common.config.topology import Topology, load_topology, topology_from_mapping
from common.gen.meridian.v1 import admin_pb2 as apb
from common.gen.meridian.v1 import admin_pb2_grpc as apb_grpc
from common.operations.admin import AdminService, TierHooks, subtree_index
from common.operations.reload import reload_children, unapplied_settings
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import ForwardingPolicy
from common.request.pick import PickRequest
from common.request.proxy import TierSpec
from common.tenancy.auth import AdminGuard, bearer_key, hash_key
from common.tier.server import TierServer
from global_lb.picker import RegionPicker
from regional_lb.server import drained
from sim.topology import one_zone_mapping
from tests.until import until

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


def test_admin_keys_are_required_even_with_auth_off() -> None:
    admins = frozenset({hash_key("mk_admin")})
    off = AdminGuard(AuthConfig(enabled=False, admin_key_hashes=admins))
    for metadata in ([], bearer("mk_other")):
        with pytest.raises(RouteError) as err:
            off.check(metadata)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    off.check(bearer("mk_admin"))


def test_auth_on_without_admin_keys_admits_nobody() -> None:
    with pytest.raises(RouteError) as err:
        AdminGuard(AuthConfig(enabled=True)).check(bearer("mk_anything"))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_bearer_key_takes_the_last_entry_and_caps_its_length() -> None:
    assert bearer_key([*bearer("one"), *bearer(" two ")]) == "two"
    with pytest.raises(RouteError) as err:
        bearer_key(bearer("k" * 600), "admin key")
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "<admin key>" in err.value.message


def admin_service(
    topology: Topology,
    reloaded: Topology,
    guard: AdminGuard | None = None,
    reload: object = None,
) -> AdminService:
    async def no_change(new: Topology) -> apb.TierReload:
        return apb.TierReload()

    hooks = TierHooks(lambda c: apb.Node(), reload or no_change)  # type: ignore[arg-type]
    children = ChildSet([], probe_interval_s=1, summary_ttl_s=1)
    return AdminService(
        "global", "global", children, topology, hooks, source=lambda: reloaded, guard=guard
    )


async def test_reload_takes_new_admin_keys_but_keeps_auth_enabled_and_tenants() -> None:
    tenant = TenantConfig(id="acme", key_hashes=frozenset({hash_key("mk_tenant")}))
    on = dataclasses.replace(
        topology(),
        auth=AuthConfig(
            enabled=True, tenants=(tenant,), admin_key_hashes=frozenset({hash_key("mk_admin")})
        ),
    )
    off = dataclasses.replace(
        on, auth=AuthConfig(enabled=False, admin_key_hashes=frozenset({hash_key("mk_new")}))
    )
    service = admin_service(on, off, AdminGuard(on.auth))
    report = await service._reload_self()
    assert "auth.enabled / auth.tenants (restart to apply)" in report.not_applied
    guard = service.guard
    assert guard is not None
    guard.check(bearer("mk_new"))  # the new admin key is taken
    for metadata, code in (
        ([], grpc.StatusCode.UNAUTHENTICATED),
        (bearer("mk_admin"), grpc.StatusCode.UNAUTHENTICATED),
        (bearer("mk_tenant"), grpc.StatusCode.PERMISSION_DENIED),  # still a known tenant
    ):
        with pytest.raises(RouteError) as err:
            guard.check(metadata)
        assert err.value.code == code
    # With auth still on at start, dropping every admin key closes the API, not opens it.
    none = dataclasses.replace(off, auth=AuthConfig(enabled=False))
    await admin_service(on, none, guard)._reload_self()
    with pytest.raises(RouteError):
        guard.check([])


async def test_a_bug_in_a_tiers_reload_is_internal_not_unknown() -> None:
    async def broken(new: Topology) -> apb.TierReload:
        raise KeyError("g7")

    service = admin_service(topology(), topology(), reload=broken)
    with pytest.raises(RouteError) as err:
        await service._reload_self()
    assert err.value.code == grpc.StatusCode.INTERNAL and "KeyError" in err.value.message


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
    request = PickRequest(M, "", GeoPoint(0, 0), None, Priority.STANDARD)
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
    headroom = dataclasses.replace(old, tenant_headroom=0.1)
    assert unapplied_settings(old, headroom, "local", "r-1a") == [
        "tenant_headroom (restart to apply)"
    ]
    region = dataclasses.replace(old.regions[0], redis_url="redis://region-r:6379/0")
    own_redis = dataclasses.replace(old, regions=(region,))
    for tier, name in (("regional", "r"), ("local", "r-1a")):
        assert unapplied_settings(old, own_redis, tier, name) == [
            "regions[r].redis_url (restart to apply)"
        ]
    assert unapplied_settings(old, own_redis, "global", "global") == []
    edges = dataclasses.replace(old, global_tier=dataclasses.replace(old.global_tier, replicas=3))
    assert unapplied_settings(old, edges, "global", "global") == [
        "global.replicas (restart to apply)"
    ]
    assert unapplied_settings(old, edges, "regional", "r") == []  # only the edge reads it


def test_own_location_is_not_applied_at_the_global_and_regional_tiers() -> None:
    old = topology_from_mapping(
        one_zone_mapping("redis://127.0.0.1:1/0", gpus=1, global_location=(1, 1))
    )
    new = topology_from_mapping(
        one_zone_mapping(
            "redis://127.0.0.1:1/0", gpus=1, global_location=(2, 2), region_location=(3, 3)
        )
    )
    moved = dataclasses.replace(new, regions=old.regions)
    assert unapplied_settings(old, moved, "global", "global") == ["own location (restart to apply)"]
    region = dataclasses.replace(new.regions[0], zones=old.regions[0].zones)
    moved = dataclasses.replace(old, regions=(region,))
    assert "own location (restart to apply)" in unapplied_settings(old, moved, "regional", "r")
    assert unapplied_settings(old, moved, "global", "global") == []


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


async def test_undrain_is_refused_while_a_removed_child_finishes() -> None:
    a, b = zone("a"), zone("b")
    children = ChildSet([a, b], probe_interval_s=1, summary_ttl_s=1.5, probe=False)
    await children.start()
    try:
        b.outstanding_requests = 1
        await reload_children(children, [zone("a")])
        assert not children.set_drained(b, False) and b.drained
        assert children.set_drained(b, True)  # draining it again is harmless
        b.outstanding_requests = 0
        await until(lambda: "b" not in children.by_name)
    finally:
        await children.stop()


async def test_a_model_is_not_found_once_the_last_child_serving_it_has_left() -> None:
    a = zone("a")
    b = dataclasses.replace(zone("b"), models=frozenset({"n"}))
    children = ChildSet([a, b], probe_interval_s=1, summary_ttl_s=1.5, probe=False)
    spec = TierSpec(tier="regional", trust_internal=True, resolve_origin=lambda h: None)
    picker = RegionPicker(GeoPoint(0, 0), 1.5)
    tier = TierServer(
        spec,
        ForwardingPolicy(kind="zone", route_prefix="r"),
        children,
        RankingBalancer(picker, children),
        Endpoint("127.0.0.1", 0),
    )
    await children.start()
    try:
        b.outstanding_requests = 1
        await reload_children(children, [zone("a")])
        assert tier.proxy.models == {M, "n"}  # b still finishes a call for n
        b.outstanding_requests = 0
        await until(lambda: "b" not in children.by_name)
        assert tier.proxy.models == {M}
    finally:
        await children.stop()


class ReloadWithAnError(apb_grpc.AdminServicer):
    def ReloadTopology(
        self, request: apb.ReloadTopologyRequest, context: grpc.ServicerContext
    ) -> apb.ReloadTopologyResponse:
        return apb.ReloadTopologyResponse(
            tiers=[
                apb.TierReload(tier="global"),
                apb.TierReload(tier="regional r", error="DEADLINE_EXCEEDED: slow"),
            ]
        )


def test_cli_reload_exits_1_when_a_tier_reports_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    apb_grpc.add_AdminServicer_to_server(ReloadWithAnError(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert admin_main(["--target", f"127.0.0.1:{port}", "reload"]) == 1
    finally:
        server.stop(None)
    out = capsys.readouterr().out
    assert "global: no change" in out and "regional r: ERROR DEADLINE_EXCEEDED" in out


async def test_reload_never_makes_a_still_valid_tenant_key_an_admin_key() -> None:
    tenant = TenantConfig(id="acme", key_hashes=frozenset({hash_key("mk_tenant")}))
    on = dataclasses.replace(
        topology(),
        auth=AuthConfig(
            enabled=True, tenants=(tenant,), admin_key_hashes=frozenset({hash_key("mk_admin")})
        ),
    )
    # The new file drops acme and lists its key as an admin key: acme's key stays a
    # tenant key until restart, so it must not open the Admin API meanwhile.
    sneaky = dataclasses.replace(
        on,
        auth=AuthConfig(
            enabled=True,
            tenants=(),
            admin_key_hashes=frozenset({hash_key("mk_tenant"), hash_key("mk_admin")}),
        ),
    )
    service = admin_service(on, sneaky, AdminGuard(on.auth))
    report = await service._reload_self()
    assert any("a key of tenant 'acme'" in line for line in report.not_applied)
    assert service.guard is not None
    with pytest.raises(RouteError) as err:
        service.guard.check(bearer("mk_tenant"))
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    service.guard.check(bearer("mk_admin"))


async def test_reload_of_a_non_utf8_topology_is_failed_precondition_naming_the_file(
    tmp_path: Path,
) -> None:
    """The README's code for a topology that does not validate, not UNKNOWN from a
    UnicodeDecodeError; and nothing changes."""
    path = tmp_path / "topology.yaml"
    path.write_bytes("regions:\n- name: eu-west\xff\n".encode("latin-1"))
    running = topology()
    service = admin_service(running, running)
    service.source = lambda: load_topology(path)
    server = grpc.aio.server()
    service.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await apb_grpc.AdminStub(channel).ReloadTopology(
                    apb.ReloadTopologyRequest(), timeout=5
                )
    finally:
        await server.stop(None)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        f"topology not reloaded, nothing changed: {path}: not UTF-8 text (byte 0xff at offset 24)"
    )
    assert service.topology is running
