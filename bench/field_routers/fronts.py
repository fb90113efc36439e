"""The fronts and the one set of emulated GPUs behind them all.

One ``cli.launcher.Fleet`` (as ``meridian up`` starts it: Redis with its ACL users, mutual
TLS between tiers, tenant auth and quotas that never bind here) of one region and one
zone of ``gpus`` emulated H100s that speak vLLM's OpenAI HTTP API. Its worker process is
the only GPU set of the run: the field's routers are pointed at the same GPU addresses,
so every front routes to the very same GPU processes. The fronts:

* ``meridian`` — the whole chain: the global tier's OpenAI edge → regional → local;
  its CPU is global + regional + local + Redis.
* ``meridian-local`` — the local tier's own OpenAI edge (``openai_listen`` in the zone's
  entry); the fleet's global and regional tiers still run above it, idle for this
  front, and their CPU is not counted; Redis is (the local tier publishes to it).
  On a commit whose topology has no such key the front is "not available".
* ``meridian-envoy`` — a real Envoy (``bench.envoy_proc``, one worker thread, the
  bootstrap ``local_lb.ext_proc_envoy`` renders: override_host cluster of the GPUs over
  HTTP/1.1) carries the requests and SSE streams, and the zone's local tier only
  decides, as Envoy's endpoint picker (the zone's ``ext_proc`` entry): it sees the
  request headers and whole body, the response headers, and the end of the exchange,
  never a token. Its CPU is Envoy + local + Redis. The picker authenticates no tenant
  (as the Rust routers here): Envoy's own filters would.
* ``smg``, ``sglang-router``, ``vllm-router`` — the PyPI wheels' binaries from their own
  virtualenv (``make routers``), each one process started once for the whole run, as
  their users start them: ``--policy cache_aware`` with its default thresholds. The only
  flags besides are a port and the Prometheus exporter's port and host (loopback, and
  one each: two on the default 29000 collide).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.envoy_proc import EnvoyProcess, envoy_binary
from bench.field_routers.client import Front
from bench.hop_cost import REGION, TENANT, ZONE, cpu_seconds
from bench.hop_cost import fleet_spec as hop_fleet_spec
from cli.launcher import Fleet
from cli.processes import TierProcess
from common.basics.redis_embed import free_port
from common.config.node import ConfigError, Endpoint
from local_lb.ext_proc_envoy import envoy_bootstrap

ROOT = Path(__file__).resolve().parent.parent.parent
ROUTERS_VENV = ROOT / ".venv-routers"
MERIDIAN = ("meridian", "meridian-local", "meridian-envoy")
RUST = ("smg", "sglang-router", "vllm-router")
ALL_FRONTS = (*MERIDIAN, *RUST)
WORKER = f"worker-{ZONE}"


def fleet_spec(
    gpus: int, time_scale: float, zone_edge: bool, ext_proc: str | None = None
) -> dict[str, Any]:
    """``bench.hop_cost``'s one-zone fleet, its GPUs on OpenAI HTTP, OpenAI edges on free
    ports (the zone's too with ``zone_edge``), the zone's endpoint picker on ``ext_proc``."""
    spec = hop_fleet_spec(gpus, time_scale)
    spec["global"]["openai_listen"] = "127.0.0.1:0"
    zone = spec["regions"][0]["zones"][0]
    for gpu in zone["gpus"]:
        gpu["protocol"] = "openai"  # metrics on the API port, as vLLM serves them
        gpu.pop("metrics_listen", None)
    if zone_edge:
        zone["openai_listen"] = "127.0.0.1:0"
    if ext_proc is not None:
        zone["ext_proc"] = {"listen": ext_proc}
    return spec


def process_tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and every live descendant (a launcher script's children)."""
    total = 0.0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            total += cpu_seconds(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # gone meanwhile
    return total


def listening(address: str, timeout_s: float) -> bool:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def router_argv(
    venv: Path, name: str, port: int, metrics_port: int, workers: list[str]
) -> list[str]:
    """How the router's users start it, on loopback (see the module docstring)."""
    binary = str(venv / "bin" / name)
    head = [binary] if name == "vllm-router" else [binary, "launch"]
    return [
        *head,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]


def ensure_routers(venv: Path) -> None:
    """``make routers`` unless ``venv`` already holds the three binaries."""
    if all((venv / "bin" / n).exists() for n in RUST):
        return
    make = ["make", "-C", str(ROOT), "routers", f"ROUTERS_VENV={venv.resolve()}"]
    subprocess.run(make, check=True)


@dataclass
class Stage:
    """The fleet, the routers, and which processes each front's CPU is read from."""

    run_dir: Path
    gpus: int
    time_scale: float
    fronts: list[str]
    routers_venv: Path = ROUTERS_VENV
    fleet: Fleet | None = None
    routers: dict[str, TierProcess] = field(default_factory=dict)
    envoy: EnvoyProcess | None = None
    picker: str | None = None  # the zone's ext_proc address (meridian-envoy)
    available: dict[str, Front] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # front: why not measured

    def _build_fleet(self) -> tuple[Fleet, bool]:
        """The fleet with the zone's OpenAI edge if this commit's topology knows the key."""
        if "meridian-envoy" in self.fronts:
            self.picker = f"127.0.0.1:{free_port()}"
        for zone_edge in (True, False):
            path = self.run_dir / f"fleet-{int(zone_edge)}.yaml"
            spec = fleet_spec(self.gpus, self.time_scale, zone_edge, self.picker)
            path.write_text(yaml.safe_dump(spec))
            try:
                return Fleet(path, self.run_dir / f"run-{int(zone_edge)}"), zone_edge
            except ConfigError as exc:
                if not zone_edge:
                    raise
                self.missing["meridian-local"] = f"not available on this commit ({exc})"
        raise AssertionError("unreachable")

    def start(self) -> None:
        fleet, zone_edge = self._build_fleet()
        self.fleet = fleet
        fleet.start(timeout_s=120)
        key = (("Authorization", f"Bearer {fleet.tenant_keys[TENANT]}"),)
        assert fleet.openai_url is not None
        self.available["meridian"] = Front("meridian", fleet.openai_url, key)
        if zone_edge:
            address = fleet.raw["regions"][0]["zones"][0]["openai_listen"]
            if listening(address, 15):
                self.available["meridian-local"] = Front(
                    "meridian-local", f"http://{address}/v1", key
                )
            else:
                self.missing["meridian-local"] = "the local tier does not listen on openai_listen"
        if self.picker is not None:
            self._start_envoy(self.picker)
        wanted = [n for n in RUST if n in self.fronts]
        if wanted:
            ensure_routers(self.routers_venv)
        for name in wanted:
            self._start_router(name)
        for name in list(self.available):
            if name not in self.fronts:
                del self.available[name]

    def _start_envoy(self, picker: str) -> None:
        """Envoy in front of the GPUs (HTTP/1.1, override_host), the zone's picker deciding."""
        if envoy_binary() is None:
            self.missing["meridian-envoy"] = "no Envoy binary: `make envoy`"
            return
        assert self.fleet is not None
        host, _, port = picker.rpartition(":")
        listen, admin = Endpoint("127.0.0.1", free_port()), Endpoint("127.0.0.1", free_port())
        bootstrap = envoy_bootstrap(
            listen=listen,
            picker=Endpoint(host, int(port)),
            admin=admin,
            gpus=[g.endpoint for g in self.fleet.topology.regions[0].zones[0].gpus],
            openai_gpus=True,
        )
        workdir = self.run_dir / "envoy"
        workdir.mkdir(exist_ok=True)
        self.envoy = EnvoyProcess(bootstrap, admin, workdir)
        try:
            asyncio.run(self.envoy.start())
        except (RuntimeError, TimeoutError) as exc:
            self.missing["meridian-envoy"] = f"Envoy did not start: {exc}"
            return
        self.available["meridian-envoy"] = Front("meridian-envoy", f"http://{listen.address}/v1")

    def _start_router(self, name: str) -> None:
        port = free_port()
        argv = router_argv(self.routers_venv, name, port, free_port(), self.gpu_urls())
        proc = TierProcess(name, argv, self.run_dir / f"{name}.log")
        self.routers[name] = proc
        proc.start()
        url = f"http://127.0.0.1:{port}"
        if wait_http(f"{url}/v1/models", 60, proc):
            self.available[name] = Front(name, f"{url}/v1")
        else:
            self.missing[name] = f"did not answer /v1/models; see {proc.log_path}"

    def gpu_urls(self) -> list[str]:
        assert self.fleet is not None
        return [
            f"http://{g.endpoint.address}" for g in self.fleet.topology.regions[0].zones[0].gpus
        ]

    def pids(self, front: str) -> dict[str, int]:
        """The processes whose CPU is the front's."""
        assert self.fleet is not None
        if front in self.routers:
            proc = self.routers[front].process
            assert proc is not None
            return {front: proc.pid}
        names = [f"local-{ZONE}"]
        out: dict[str, int] = {}
        if front == "meridian-envoy":
            assert self.envoy is not None and self.envoy.process is not None
            out["envoy"] = self.envoy.process.pid
        if front == "meridian":
            names = ["global", f"regional-{REGION}", *names]
        out.update({n: _pid(self.fleet.processes[n]) for n in names})
        assert self.fleet.redis is not None and self.fleet.redis.process is not None
        out["redis"] = self.fleet.redis.process.pid
        return out

    def gpu_pid(self) -> int:
        assert self.fleet is not None
        return _pid(self.fleet.processes[WORKER])

    def stop(self) -> None:
        """Every process this stage started, Envoy and the routers first, then the fleet
        top down."""
        try:
            if self.envoy is not None:
                asyncio.run(self.envoy.stop())
            for proc in self.routers.values():
                proc.stop()
        finally:
            if self.fleet is not None:
                self.fleet.stop()


def _pid(proc: TierProcess) -> int:
    assert proc.process is not None
    return proc.process.pid


def wait_http(url: str, timeout_s: float, proc: TierProcess) -> bool:
    """Until ``url`` answers 200 (False if ``proc`` exits or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.alive():
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


def gpu_counters(urls: list[str]) -> dict[str, float]:
    """The GPUs' vLLM-named counters and gauges, summed over GPUs (their /metrics)."""
    total: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            total[key] = total.get(key, 0.0) + float(value)
    return total


def wait_gpus_idle(urls: list[str], timeout_s: float) -> bool:
    """Until no GPU runs or queues a request (False if that takes over ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c = gpu_counters(urls)
        if c.get("vllm:num_requests_running", 0) + c.get("vllm:num_requests_waiting", 0) == 0:
            return True
        time.sleep(0.2)
    return False


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
