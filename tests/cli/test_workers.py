"""``meridian local --workers 2``: real processes through the CLI (a supervisor, its two
workers, one zone's emulated GPU), every one stopped however the test ends.

Both workers serve on the one port (SO_REUSEPORT) and each counts its own calls on its
own ops port; together they never run more on the GPU than its max_concurrency; their
summaries combine to the zone's whole capacity; SIGTERM stops both with no call lost;
a killed worker is restarted, one that keeps dying stops the supervisor; bad values
fail before any worker starts, naming the flag or key.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import yaml

from cli.launcher import resolve_ports
from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import SUMMARY_FIELD, zone_stream
from common.capacity.summary import combine_replicas
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.gen.meridian.v1 import admin_pb2 as apb
from common.gen.meridian.v1 import admin_pb2_grpc as apb_grpc
from common.gen.meridian.v1 import capacity_pb2
from common.request.v2 import generate_request, response_text
from tests.cli.conftest import Launch
from tests.cli.procs import ROOT, CliProcess
from tests.conftest import small_fleet_spec

SLOTS = 4  # the GPU's max_concurrency: 2 slots per worker
MODEL = "demo-llm"
# Long enough that requests overlap on the GPU (emulated time, TEST_TIME_SCALE).
MAX_TOKENS = 96


def two_free_ports() -> int:
    """A port p with p and p + 1 free (worker 0's and worker 1's ops)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


@pytest.fixture
def zone(tmp_path: Path, redis_server: EmbeddedRedis) -> dict[str, Any]:
    spec = resolve_ports(small_fleet_spec(regions=1, zones=1, gpus=1))
    spec["redis_url"] = redis_server.url
    z = spec["regions"][0]["zones"][0]
    z["gpus"][0]["max_concurrency"] = SLOTS
    z["ops_listen"] = f"127.0.0.1:{two_free_ports()}"
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(spec))
    where = ["--config", str(config), "--region", spec["regions"][0]["name"], "--zone", z["name"]]
    return {"spec": spec, "zone": z, "where": where, "config": config}


def ops_port(zone: dict[str, Any], worker: int) -> int:
    return int(zone["zone"]["ops_listen"].rsplit(":", 1)[1]) + worker


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""
    except OSError:
        return 0, ""


def wait_ready(zone: dict[str, Any], workers: int = 2, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(
            http_get(f"http://127.0.0.1:{ops_port(zone, w)}/readyz")[0] == 200
            for w in range(workers)
        ):
            return
        time.sleep(0.1)
    raise AssertionError("the workers did not become ready")


def served(zone: dict[str, Any], worker: int) -> float:
    """meridian_requests_total of one worker, over every label set (its own ops port)."""
    status, text = http_get(f"http://127.0.0.1:{ops_port(zone, worker)}/metrics")
    assert status == 200
    total = 0.0
    for line in text.splitlines():
        if line.startswith("meridian_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def gpu_gauges(zone: dict[str, Any]) -> tuple[float, float]:
    """The GPU's own running and waiting counts (its vLLM-style /metrics)."""
    _, text = http_get(f"http://{zone['zone']['gpus'][0]['metrics_listen']}/metrics")
    values = {"running": 0.0, "waiting": 0.0}
    for line in text.splitlines():
        for key in values:
            if line.startswith(f"vllm:num_requests_{key}"):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values["running"], values["waiting"]


def call(address: str, prompt: str) -> str:
    """One request on a connection of its own (grpcio shares one connection between a
    process's channels to one address unless told not to), so the kernel spreads them
    over the workers."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(generate_request(MODEL, prompt, MAX_TOKENS), timeout=60)
        return response_text(reply)


def start_zone(zone: dict[str, Any], launch: Launch) -> CliProcess:
    launch(["worker", *zone["where"]], "gpus")
    local = launch(
        ["local", *zone["where"], "--workers", "2", "--grace", "20", "--log-format", "json"],
        "local",
    )
    wait_ready(zone)
    return local


def test_two_workers_share_the_port_and_never_exceed_a_gpus_slots(
    zone: dict[str, Any], launch: Launch, redis_server: EmbeddedRedis
) -> None:
    local = start_zone(zone, launch)
    address = zone["zone"]["listen"]
    peak = {"running": 0.0, "at_gpu": 0.0}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            running, waiting = gpu_gauges(zone)
            peak["running"] = max(peak["running"], running)
            peak["at_gpu"] = max(peak["at_gpu"], running + waiting)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            texts = list(pool.map(lambda i: call(address, f"prompt {i}"), range(36)))
    finally:
        done.set()
        watcher.join()
    assert len(texts) == 36 and all(texts)  # none lost
    counts = [served(zone, 0), served(zone, 1)]
    assert sum(counts) == 36 and min(counts) > 0, counts  # both served, each its own
    # Each worker holds 2 of the 4 slots: the GPU never held more requests than its slots.
    # (A request that arrives mid-step waits for the step's end even beside a free slot,
    # as in vLLM, so "waiting" alone can read 1 while fewer than 4 run: one scrape's sum.)
    assert 0 < peak["running"] and peak["at_gpu"] <= SLOTS, peak

    # Each worker's zone summary counts the GPU's slots whole; combined: the zone's 4.
    r = redis.Redis.from_url(redis_server.url)
    try:
        spec = zone["spec"]
        entries = r.xrevrange(zone_stream(spec["regions"][0]["name"], zone["zone"]["name"]))
    finally:
        r.close()
    (started,) = local.events("workers_started")
    pids = started["pids"].split()
    newest: dict[str, capacity_pb2.CapacitySummary] = {}
    for _, fields in entries:  # the session's Redis: other tests' processes published too
        summary = capacity_pb2.CapacitySummary.FromString(fields[SUMMARY_FIELD])
        if summary.source_id.rsplit("/", 1)[1].split("-")[0] in pids:  # local/r/z/<pid>-<hex>
            newest.setdefault(summary.source_id, summary)
    assert len(newest) == 2  # one replica per worker
    combined = combine_replicas(list(newest.values()))
    assert combined.models[0].total_slots == SLOTS


def test_sigterm_stops_both_workers_and_loses_no_call_in_flight(
    zone: dict[str, Any], launch: Launch
) -> None:
    local = start_zone(zone, launch)
    (started,) = local.events("workers_started")
    pids = [int(p) for p in started["pids"].split()]
    address = zone["zone"]["listen"]
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(call, address, f"in flight {i}") for i in range(8)]
        deadline = time.monotonic() + 20
        # Until calls are on the GPU: a worker's share of its slots at least (the kernel
        # may hand every connection to one worker, whose other calls then wait in its
        # queue; waiting for all four slots took the whole 20 s then).
        running = 0.0
        while running < SLOTS // 2 and time.monotonic() < deadline:
            time.sleep(0.01)
            running = gpu_gauges(zone)[0]
        assert running >= SLOTS // 2, "the calls never reached the GPU"
        local.popen.send_signal(signal.SIGTERM)
        texts = [c.result(timeout=60) for c in calls]
    assert all(texts)
    assert local.popen.wait(60) == 0
    for pid in pids:  # both workers are gone (not merely orphaned)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert len(local.events("tier_stopped")) == 2


def test_admin_changes_are_refused_since_they_would_reach_one_worker(
    zone: dict[str, Any], launch: Launch
) -> None:
    start_zone(zone, launch)
    gpu = zone["zone"]["gpus"][0]["name"]
    with grpc.insecure_channel(zone["zone"]["listen"]) as channel:
        admin = apb_grpc.AdminStub(channel)
        calls = [
            (admin.Drain, apb.DrainRequest(target=gpu)),
            (admin.Undrain, apb.DrainRequest(target=gpu)),
            (admin.SetWeight, apb.SetWeightRequest(gpu=gpu, weight=2.0)),
            (admin.ReloadTopology, apb.ReloadTopologyRequest()),
        ]
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as err:
                method(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "runs as 2 workers on one port (--workers 2)" in err.value.details()
        (node,) = admin.ListTopology(apb.ListTopologyRequest(), timeout=10).nodes
        assert node.name == gpu and not node.drained  # nothing was changed
    assert call(zone["zone"]["listen"], "still served")


def test_a_killed_worker_is_restarted_and_the_other_serves_meanwhile(
    zone: dict[str, Any], launch: Launch
) -> None:
    local = start_zone(zone, launch)
    (started,) = local.events("workers_started")
    victim = int(started["pids"].split()[1])
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not local.events("worker_died") and time.monotonic() < deadline:
        time.sleep(0.01)
    (died,) = local.events("worker_died")
    assert died["worker"] == 1 and died["code"] == -signal.SIGKILL
    # Reaped (so its listener is closed) and not yet back: the other one serves. (A
    # connection that reached the dying one's accept queue before was reset.)
    assert call(zone["zone"]["listen"], "while one is down")
    wait_ready(zone)  # worker 1 back on its ops port
    assert len(local.events("tier_started")) == 3
    assert local.popen.poll() is None


def test_a_worker_that_keeps_dying_stops_the_supervisor(
    zone: dict[str, Any], launch: Launch
) -> None:
    local = start_zone(zone, launch)
    (started,) = local.events("workers_started")
    pending = [int(started["pids"].split()[0])]  # worker 0, then each of its restarts
    killed: set[int] = set()
    deadline = time.monotonic() + 60
    while local.popen.poll() is None and time.monotonic() < deadline:
        pending += [d["restarted_pid"] for d in local.events("worker_died") if "restarted_pid" in d]
        for pid in set(pending) - killed:
            killed.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    assert local.popen.wait(30) == 1
    deaths = local.events("worker_died")
    assert len(deaths) == 4 and all(d["worker"] == 0 for d in deaths)  # 3 restarts, then no
    assert [d["level"] for d in deaths] == ["warning"] * 3 + ["error"]
    assert len(local.events("tier_stopped")) >= 1  # worker 1 was stopped gracefully


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_workers_value_names_the_flag(zone: dict[str, Any], value: str) -> None:
    argv = [sys.executable, "-m", "cli.main", "local", *zone["where"], "--workers", value]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"argument --workers: must be a whole number > 0, not '{value}'" in done.stderr


def rewrite(zone: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> None:
    spec = zone["spec"]
    change(spec["regions"][0]["zones"][0])
    zone["config"].write_text(yaml.safe_dump(spec))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda z: z.update(listen="127.0.0.1:0"),
            "regions[0].zones[0].listen: port 0 picks a port per process",
        ),
        (
            lambda z: z["gpus"][0].update(max_concurrency=1),
            "regions[0].zones[0].gpus[0].max_concurrency: 1 slots cannot be split between 2",
        ),
    ],
)
def test_a_topology_the_workers_cannot_share_fails_before_any_starts(
    zone: dict[str, Any], change: Callable[[dict[str, Any]], None], message: str
) -> None:
    rewrite(zone, change)
    argv = [sys.executable, "-m", "cli.main", "local", *zone["where"], "--workers", "2"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_taken_port_fails_before_any_worker_starts(zone: dict[str, Any]) -> None:
    host, port = zone["zone"]["listen"].rsplit(":", 1)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # a stray sharer
        taken.bind((host, int(port)))
        taken.listen()
        argv = [sys.executable, "-m", "cli.main", "local", *zone["where"], "--workers", "2"]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"cannot listen on {zone['zone']['listen']} for --workers" in done.stderr
