"""The Admin API end to end: list, drain and undrain under load, weights, status codes.

One fleet (2 regions x 2 zones x 2 GPUs) is shared by these tests; each test
undoes what it drained or weighted, even when it fails.
"""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from cli.admin import admin_main
from cli.launcher import Fleet
from common.gen.meridian.v1 import admin_pb2 as apb
from common.gen.meridian.v1 import admin_pb2_grpc as apb_grpc
from tests.client import LoadLoop, V2Client, expect_code, region_of, zone_of
from tests.conftest import small_fleet_spec, start_fleet

DUBLIN = ("x-meridian-client-geo", "53.35,-6.26")


class Admin:
    """A blocking Admin client over one channel."""

    def __init__(self, address: str, key: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = apb_grpc.AdminStub(self.channel)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def close(self) -> None:
        self.channel.close()

    def list(self) -> list[apb.Node]:
        return list(
            self.stub.ListTopology(
                apb.ListTopologyRequest(), metadata=self.metadata, timeout=10
            ).nodes
        )

    def drain(self, target: str) -> apb.AdminActionResponse:
        return self.stub.Drain(apb.DrainRequest(target=target), metadata=self.metadata, timeout=10)

    def undrain(self, target: str) -> apb.AdminActionResponse:
        return self.stub.Undrain(
            apb.DrainRequest(target=target), metadata=self.metadata, timeout=10
        )

    def weight(self, gpu: str, weight: float) -> apb.AdminActionResponse:
        return self.stub.SetWeight(
            apb.SetWeightRequest(gpu=gpu, weight=weight), metadata=self.metadata, timeout=10
        )

    def reload(self) -> apb.ReloadTopologyResponse:
        return self.stub.ReloadTopology(
            apb.ReloadTopologyRequest(), metadata=self.metadata, timeout=20
        )


def flatten(nodes: list[apb.Node]) -> dict[str, apb.Node]:
    out: dict[str, apb.Node] = {}
    for node in nodes:
        out[node.name] = node
        out.update(flatten(list(node.children)))
    return out


def gpu_of(route: str) -> str:
    return route.split("/")[2]


def gpu_counter(fleet: Fleet, gpu_name: str, metric: str) -> float:
    """``metric`` summed over its label sets on one emulated GPU's /metrics."""
    for region in fleet.topology.regions:
        for zone in region.zones:
            for gpu in zone.gpus:
                if gpu.name != gpu_name:
                    continue
                url = f"http://{gpu.metrics_endpoint.address}/metrics"
                with urllib.request.urlopen(url, timeout=5) as reply:
                    lines = reply.read().decode().splitlines()
                return sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in lines
                    if line.startswith((f"{metric}{{", f"{metric} "))
                )
    raise KeyError(gpu_name)


def wait_idle(fleet: Fleet, gpu: str, deadline: float) -> None:
    """Return once ``gpu`` runs and queues no request; fail at ``deadline``."""
    while True:
        busy = gpu_counter(fleet, gpu, "vllm:num_requests_running") + gpu_counter(
            fleet, gpu, "vllm:num_requests_waiting"
        )
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"{gpu} still has {busy:g} requests"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = start_fleet(tmp_path_factory.mktemp("admin"), small_fleet_spec(2, 2, 2))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def admin(fleet: Fleet) -> Iterator[Admin]:
    client = Admin(fleet.global_address)
    try:
        yield client
    finally:
        client.close()


def busiest(routes: list[str], part: int) -> str:
    return collections.Counter(r.split("/")[part] for r in routes if r).most_common(1)[0][0]


def test_list_topology_shows_every_region_zone_and_gpu(fleet: Fleet, admin: Admin) -> None:
    nodes = admin.list()
    assert [n.name for n in nodes] == [r.name for r in fleet.topology.regions]
    for region, node in zip(fleet.topology.regions, nodes, strict=True):
        assert node.kind == "region" and node.healthy and not node.drained and not node.error
        assert [z.name for z in node.children] == [z.name for z in region.zones]
        for zone_cfg, zone in zip(region.zones, node.children, strict=True):
            assert zone.kind == "zone" and zone.healthy
            gpus = {g.name: g for g in zone.children}
            assert set(gpus) == {g.name for g in zone_cfg.gpus}
            for cfg in zone_cfg.gpus:
                gpu = gpus[cfg.name]
                assert gpu.kind == "gpu" and gpu.hardware == cfg.hardware
                assert gpu.weight == 1.0 and gpu.total_slots == cfg.max_concurrency
                assert gpu.endpoint == cfg.endpoint.address and gpu.rate > 0


def test_cli_lists_a_table_and_fails_with_the_status(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    assert admin_main(["--target", fleet.global_address, "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["NAME", "KIND", "HEALTH"]
    for region in fleet.topology.regions:
        for zone in region.zones:
            assert all(g.name in out for g in zone.gpus)
    assert admin_main(["--target", fleet.global_address, "drain", "no-such-gpu"]) == 1
    err = capsys.readouterr().err
    assert "NOT_FOUND" in err and "no-such-gpu" in err
    # The same through the `meridian` command itself.
    argv = [sys.executable, "-m", "cli.main", "admin", "--target", fleet.global_address]
    listed = subprocess.run([*argv, "list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0 and "eu-west-1a-gpu0" in listed.stdout
    failed = subprocess.run(
        [*argv, "undrain", "nowhere"], capture_output=True, text=True, timeout=30
    )
    assert failed.returncode == 1 and "NOT_FOUND" in failed.stderr


def test_status_codes(admin: Admin) -> None:
    err = expect_code(grpc.StatusCode.NOT_FOUND, admin.drain, "atlantis")
    assert "atlantis" in (err.details() or "")
    expect_code(grpc.StatusCode.NOT_FOUND, admin.undrain, "atlantis")
    expect_code(grpc.StatusCode.NOT_FOUND, admin.weight, "atlantis", 2.0)
    for bad in (0.0, -1.0, math.nan, math.inf):
        err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, admin.weight, "us-east-1a-gpu0", bad)
        assert "weight" in (err.details() or "")
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, admin.weight, "us-east-1a", 2.0)
    assert "zone" in (err.details() or "")


def test_drain_a_gpu_under_load_loses_nothing_and_gives_it_nothing_new(
    fleet: Fleet, admin: Admin
) -> None:
    with LoadLoop(fleet.global_address, [DUBLIN], clients=4) as load:
        time.sleep(0.8)
        gpu = busiest([s.route for s in load.since(0)], 2)
        try:
            done = admin.drain(gpu)
            assert (done.kind, done.applied_by) == ("gpu", f"local {gpu.rsplit('-', 1)[0]}")
            drained_at = time.monotonic()
            # The requests it had finish (however long that takes on a busy machine) ...
            wait_idle(fleet, gpu, deadline=drained_at + 10)
            served = gpu_counter(fleet, gpu, "vllm:request_success_total")
            # ... and from then on it gets nothing new.
            time.sleep(1.0)
            assert gpu_counter(fleet, gpu, "vllm:request_success_total") == served
            assert gpu_counter(fleet, gpu, "vllm:num_requests_running") == 0
            after = load.since(drained_at + 0.05)
            assert after and all(gpu_of(s.route) != gpu for s in after)
            node = flatten(admin.list())[gpu]
            assert node.drained and node.healthy  # not a failure: still healthy
        finally:
            admin.undrain(gpu)
        undrained_at = time.monotonic()
        deadline = undrained_at + 5
        while time.monotonic() < deadline:
            if any(gpu_of(s.route) == gpu for s in load.since(undrained_at)):
                break
            time.sleep(0.1)
    assert load.failures() == []
    assert any(gpu_of(s.route) == gpu for s in load.since(undrained_at))


def test_drain_a_zone_under_load_moves_its_traffic_to_the_other_zone(
    fleet: Fleet, admin: Admin
) -> None:
    with LoadLoop(fleet.global_address, [DUBLIN], clients=4) as load:
        time.sleep(0.8)
        zone = busiest([s.route for s in load.since(0)], 1)
        try:
            done = admin.drain(zone)
            assert (done.kind, done.applied_by) == ("zone", "regional eu-west")
            drained_at = time.monotonic()
            time.sleep(1.0)
            after = load.since(drained_at + 0.05)
            assert flatten(admin.list())[zone].drained
        finally:
            admin.undrain(zone)
    assert load.failures() == []
    # Half the region's GPUs are drained: the global spills part of its traffic to
    # us-east (overprovisioning 1.4 x 50 %), the rest goes to the other zone.
    zones = collections.Counter(zone_of(s.route) for s in after)
    assert after and zone not in zones, (zone, zones)
    assert any(z.startswith("eu-west") for z in zones), zones


def test_drain_a_region_under_load_fails_over_and_all_drained_is_unavailable(
    fleet: Fleet, admin: Admin
) -> None:
    try:
        with LoadLoop(fleet.global_address, [DUBLIN], clients=4) as load:
            time.sleep(0.5)
            assert admin.drain("eu-west").applied_by == "global"
            drained_at = time.monotonic()
            time.sleep(1.0)
            after = load.since(drained_at + 0.05)
        assert load.failures() == []
        regions = collections.Counter(region_of(s.route) for s in after)
        assert after and set(regions) == {"us-east"}, regions
        admin.drain("us-east")
        with V2Client(fleet.global_address) as client:
            err = expect_code(grpc.StatusCode.UNAVAILABLE, client.infer, metadata=[DUBLIN])
        assert "drained" in (err.details() or "")
    finally:
        admin.undrain("us-east")
        admin.undrain("eu-west")
    with V2Client(fleet.global_address) as client:
        # eu-west takes traffic again (a share of it may still spill while the global's
        # summary of eu-west is the one from a moment ago).
        routes = [region_of(client.infer(metadata=[DUBLIN]).route) for _ in range(10)]
    assert "eu-west" in routes


def test_set_weight_shifts_a_gpus_share(fleet: Fleet, admin: Admin) -> None:
    zone = fleet.topology.region("eu-west").zones[0]
    # Pin the load to one zone: drain the other.
    other = fleet.topology.region("eu-west").zones[1].name
    fast, slow = zone.gpus[0].name, zone.gpus[1].name
    admin.drain(other)
    try:

        def shares() -> collections.Counter[str]:
            with LoadLoop(fleet.global_address, [DUBLIN], clients=4) as load:
                time.sleep(1.5)
            assert load.failures() == []
            return collections.Counter(gpu_of(s.route) for s in load.since(0))

        before = shares()
        admin.weight(fast, 0.05)
        done = admin.weight(slow, 8.0)
        assert (done.kind, done.detail) == ("gpu", "weight 8")
        after = shares()
        assert flatten(admin.list())[slow].weight == 8.0
    finally:
        admin.weight(fast, 1.0)
        admin.weight(slow, 1.0)
        admin.undrain(other)
    share = {name: c[slow] / max(1, c[slow] + c[fast]) for name, c in (("b", before), ("a", after))}
    assert share["a"] > share["b"] + 0.2, (before, after)


def test_list_still_answers_when_a_region_is_down(fleet: Fleet, admin: Admin) -> None:
    fleet.kill("regional-us-east")
    try:
        started = time.monotonic()
        nodes = {n.name: n for n in admin.list()}
        assert time.monotonic() - started < 5
        assert nodes["us-east"].error and not nodes["us-east"].children
        assert not nodes["eu-west"].error and len(nodes["eu-west"].children) == 2
    finally:
        fleet.restart("regional-us-east")
