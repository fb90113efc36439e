"""Admin API with authentication on, and ReloadTopology under load.

One fleet (1 region x 1 zone x 2 GPUs, auth on with a tenant and an admin
key). The reload test starts one extra emulated GPU worker itself and stops
it when it ends, whatever happened, after reloading the original topology
so the fleet is as it was.
"""

from __future__ import annotations

import copy
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from cli.admin import KEY_ENV, admin_main
from cli.launcher import Fleet, tier_ready
from cli.processes import TierProcess
from common.basics.redis_embed import free_port
from common.gen.meridian.v1 import admin_pb2 as apb
from common.gen.meridian.v1 import admin_pb2_grpc as apb_grpc
from tests.client import LoadLoop, expect_code
from tests.conftest import small_fleet_spec, start_fleet
from tests.e2e.test_admin import Admin, flatten, gpu_of

REGION, ZONE = "us-east", "us-east-1a"
KEPT, REMOVED, ADDED = f"{ZONE}-gpu0", f"{ZONE}-gpu1", f"{ZONE}-gpu9"
# Tokens per request in the reload test: calls long enough (~0.8 s here) to be still
# in flight on the removed GPU when the reload's reply arrives.
LONG = 6000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = small_fleet_spec(regions=1, zones=1, gpus=2)
    spec["auth"] = {
        "enabled": True,
        "admin_key": "generate",
        "tenants": [{"id": "acme", "api_key": "generate"}],
    }
    spec["slow_start_window_s"] = 0.5  # a GPU added by a reload takes traffic soon
    started = start_fleet(tmp_path_factory.mktemp("admin-reload"), spec)
    try:
        yield started
    finally:
        started.stop()


def keys(fleet: Fleet) -> tuple[str, str]:
    assert fleet.admin_key is not None
    return fleet.admin_key, fleet.tenant_keys["acme"]


def test_admin_calls_need_an_admin_key_at_the_global(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    admin_key, tenant_key = keys(fleet)
    for key, code in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("mk_wrong", grpc.StatusCode.UNAUTHENTICATED),
        (tenant_key, grpc.StatusCode.PERMISSION_DENIED),
    ):
        client = Admin(fleet.global_address, key)
        try:
            err = expect_code(code, client.list)
            expect_code(code, client.drain, KEPT)
            expect_code(code, client.weight, KEPT, 2.0)
            expect_code(code, client.reload)
        finally:
            client.close()
        if key == tenant_key:
            assert "acme" in (err.details() or "")
    client = Admin(fleet.global_address, admin_key)
    try:
        assert not flatten(client.list())[KEPT].drained
    finally:
        client.close()
    # Inner tiers take admin calls only from the tier above (mutual TLS).
    with grpc.insecure_channel(fleet.endpoint_of(f"regional-{REGION}")) as channel:
        stub = apb_grpc.AdminStub(channel)
        expect_code(
            grpc.StatusCode.UNAVAILABLE, stub.ListTopology, apb.ListTopologyRequest(), timeout=5
        )
    # The CLI takes the key from --key or the environment.
    target = ["--target", fleet.global_address]
    assert admin_main([*target, "list"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert admin_main([*target, "--key", admin_key, "list"]) == 0
    monkeypatch.setenv(KEY_ENV, admin_key)
    assert admin_main([*target, "list"]) == 0
    assert KEPT in capsys.readouterr().out


def write_topology(path: Path, raw: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def zone_of_raw(raw: dict[str, Any]) -> dict[str, Any]:
    zone: dict[str, Any] = raw["regions"][0]["zones"][0]
    assert zone["name"] == ZONE
    return zone


@pytest.fixture
def extra_worker(fleet: Fleet, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """One more emulated GPU in the zone, served by a worker process of its own."""
    gpu = {
        "name": ADDED,
        "hardware": "A100",
        "models": ["demo-llm"],
        "listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": f"127.0.0.1:{free_port()}",
    }
    raw = copy.deepcopy(fleet.raw)
    zone_of_raw(raw)["gpus"] = [gpu]
    config = tmp_path / "extra.yaml"
    write_topology(config, raw)
    argv = [sys.executable, "-m", "cli.main", "worker", "--config", str(config)]
    proc = TierProcess(
        "extra-worker", [*argv, "--region", REGION, "--zone", ZONE], tmp_path / "w.log"
    )
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while not tier_ready(gpu["listen"]):
            assert proc.alive() and time.monotonic() < deadline, "extra worker did not start"
            time.sleep(0.05)
        yield gpu
    finally:
        proc.stop()


def test_reload_under_load_adds_and_removes_gpus_and_loses_nothing(
    fleet: Fleet, extra_worker: dict[str, Any]
) -> None:
    admin_key, tenant_key = keys(fleet)
    admin = Admin(fleet.global_address, admin_key)
    original = fleet.config_path.read_text()
    try:
        # A bad file changes nothing and says why.
        broken = copy.deepcopy(fleet.raw)
        zone_of_raw(broken)["gpus"][0]["hardware"] = "TPU"
        write_topology(fleet.config_path, broken)
        err = expect_code(grpc.StatusCode.FAILED_PRECONDITION, admin.reload)
        assert "unknown hardware class 'TPU'" in (err.details() or "")
        assert {KEPT, REMOVED} <= set(flatten(admin.list()))

        new = copy.deepcopy(fleet.raw)
        zone_of_raw(new)["gpus"] = [zone_of_raw(new)["gpus"][0], extra_worker]
        new["global"]["listen"] = f"127.0.0.1:{free_port()}"  # not applied while running
        metadata = [("authorization", f"Bearer {tenant_key}")]
        # REMOVED is preferred (the reload forgets its weight) and requests are long, so
        # it has calls in flight when the reload retires it.
        admin.weight(REMOVED, 50.0)
        with LoadLoop(fleet.global_address, metadata, clients=4, max_tokens=LONG) as load:
            busy_by = time.monotonic() + 10
            while flatten(admin.list())[REMOVED].outstanding_requests == 0:
                assert time.monotonic() < busy_by, f"{REMOVED} never had a call in flight"
                time.sleep(0.02)
            write_topology(fleet.config_path, new)
            reply = admin.reload()
            reloaded_at = time.monotonic()
            # Removed but still finishing its calls: the wait-then-close path runs.
            leaving = flatten(admin.list()).get(REMOVED)
            assert leaving is not None and leaving.drained and leaving.outstanding_requests > 0
            deadline = reloaded_at + 8
            while time.monotonic() < deadline:
                if ADDED in {gpu_of(s.route) for s in load.since(reloaded_at)}:
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            after = load.since(reloaded_at + 0.05)
        assert load.failures() == []
        tiers = {t.tier: t for t in reply.tiers}
        assert set(tiers) == {"global", f"regional {REGION}", f"local {ZONE}"}
        assert not any(t.error for t in reply.tiers)
        assert list(tiers[f"local {ZONE}"].added) == [ADDED]
        assert list(tiers[f"local {ZONE}"].removed) == [REMOVED]
        assert any("own listen address" in n for n in tiers["global"].not_applied)
        routes = {gpu_of(s.route) for s in after}
        assert ADDED in routes and REMOVED not in routes
        gpus = flatten(admin.list())
        assert ADDED in gpus and REMOVED not in gpus and gpus[ADDED].healthy
    finally:
        restore(fleet, admin, original)
        admin.close()


def restore(fleet: Fleet, admin: Admin, original: str) -> None:
    """Reload the fleet's own topology: REMOVED is back (and up), ADDED goes."""
    fleet.config_path.write_text(original)
    admin.reload()
    deadline = time.monotonic() + 15
    while True:
        gpus = flatten(admin.list())
        if ADDED not in gpus and REMOVED in gpus and gpus[REMOVED].healthy:
            return
        assert time.monotonic() < deadline, "the original topology did not come back"
        time.sleep(0.1)


def test_meridian_up_prints_an_admin_key_that_works(tmp_path: Path) -> None:
    spec = small_fleet_spec(regions=1, zones=1, gpus=1)
    spec["auth"] = {
        "enabled": True,
        "admin_key": "generate",
        "tenants": [{"id": "acme", "api_key": "generate"}],
    }
    config = tmp_path / "fleet.yaml"
    write_topology(config, spec)
    argv = [sys.executable, "-m", "cli.main", "up", "--config", str(config)]
    # Its own session: the tiers it starts share its process group, which a hung
    # `up` is killed with.
    up = subprocess.Popen(
        [*argv, "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None
        # readline() blocks: a thread reads, the test waits on the queue with a timeout.
        out: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [out.put(ln) for ln in up.stdout or ()], daemon=True
        ).start()
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not lines or not lines[-1].startswith("ready"):
            try:
                line = out.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("no 'ready' from meridian up:\n" + "".join(lines)) from None
            lines.append(line)
        found = {k: v for k, v in (ln.split(" ", 1) for ln in lines) if k in ("admin", "global")}
        key = found["admin"].split()[-1]
        address = found["global"].split()[1]
        assert found["admin"].startswith("key mk_")
        client = Admin(address, key)
        try:
            assert [n.name for n in client.list()] == [REGION]
        finally:
            client.close()
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
            raise
