"""A Meridian fleet spread over hosts (``tests.multihost.hosts``): one per tier site.

Hosts: ``global`` runs the global tier; each region's host runs its regional tier, its
zones' local tiers and their emulated GPUs (``meridian worker``); each Redis runs on a
host of its own (``redis`` for the global one), so a region can be cut from its Redis
while its link to the global host stays up. Links: global—region for every region,
redis—global, and a region's link to the Redis it uses. Every process binds its host's
service address, so the topology's ``listen`` addresses are the hosts' own.

Redis per region: the topology seam ``regions[].redis_url`` (owner h-redis) is not on
main yet, so every tier uses the one Redis on the ``redis`` host (each region reaching it
over a link of its own). ``FleetShape.redis_per_region`` turns on by itself once the
topology parses the key (checked against h-redis's branch): it gives each region a Redis
host ``<region>-redis`` and its ``redis_url``, which holds
that region's zone summaries; the global Redis keeps the region summaries, quotas and
usage records, so every region keeps its link to it too.

The harness's own process lives in no host's network: it reaches a host's servers through
that host's door (``tests.multihost.door``), Unix sockets relayed to TCP on the host, and
each Redis also listens on a Unix socket. Both are files, and files cross namespaces.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis
import yaml

from cli.launcher import DEMO_FLEET
from cli.readiness import tier_ready
from common.basics.redis_embed import redis_server_binary
from common.config.topology import RegionConfig, Topology, topology_from_mapping
from common.tenancy.usage_record import USAGE_STREAM
from tests.client import V2Client, region_of
from tests.multihost.hosts import HostProcess, Hosts

GLOBAL_PORT, REGION_PORT, ZONE_PORT, GPU_PORT, GPU_METRICS_PORT = 7000, 7100, 7200, 7300, 7500
REDIS_PORT = 6379
TIME_SCALE = 0.05  # emulated GPUs 20x faster than real time, as in the other e2e tests


def per_region_redis_parsed() -> bool:
    """Whether this checkout's topology parses ``regions[].redis_url`` (the seam)."""
    return "redis_url" in {f.name for f in dataclasses.fields(RegionConfig)}


@dataclass(frozen=True)
class FleetShape:
    regions: int = 2
    zones: int = 1
    gpus: int = 2
    # A Redis host per region as soon as the topology knows regions[].redis_url.
    redis_per_region: bool = field(default_factory=per_region_redis_parsed)
    failback_window_s: float = 10.0


def fleet_spec(shape: FleetShape) -> dict[str, Any]:
    """The demo fleet cut to ``shape``: same places, no auth, no ops/OpenAI HTTP."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["auth"] = {"enabled": False, "tenants": []}
    spec["time_scale"] = TIME_SCALE
    spec["failback_window_s"] = shape.failback_window_s
    spec.pop("tls", None)
    for key in ("ops_listen", "openai_listen"):
        spec["global"].pop(key, None)
    spec["regions"] = spec["regions"][: shape.regions]
    for region in spec["regions"]:
        region.pop("ops_listen", None)
        region["zones"] = region["zones"][: shape.zones]
        for zone in region["zones"]:
            zone.pop("ops_listen", None)
            zone["gpus"] = zone["gpus"][: shape.gpus]
    return copy.deepcopy(spec)


def place(spec: dict[str, Any], hosts: Hosts, shape: FleetShape) -> dict[str, Any]:
    """Give every server its host's address, and every tier its Redis."""
    spec["global"]["listen"] = f"{hosts.hosts['global'].address}:{GLOBAL_PORT}"
    spec["redis_url"] = f"redis://{hosts.hosts['redis'].address}:{REDIS_PORT}/0"
    for region in spec["regions"]:
        addr = hosts.hosts[region["name"]].address
        region["listen"] = f"{addr}:{REGION_PORT}"
        if shape.redis_per_region:
            redis_host = hosts.hosts[f"{region['name']}-redis"].address
            region["redis_url"] = f"redis://{redis_host}:{REDIS_PORT}/0"
        gpu_n = 0
        for z, zone in enumerate(region["zones"]):
            zone["listen"] = f"{addr}:{ZONE_PORT + z}"
            for gpu in zone["gpus"]:
                gpu["listen"] = f"{addr}:{GPU_PORT + gpu_n}"
                gpu["metrics_listen"] = f"{addr}:{GPU_METRICS_PORT + gpu_n}"
                gpu_n += 1
    return spec


class MultiHostFleet:
    """The fleet on its hosts; ``start()`` / ``stop()`` (``stop`` removes the hosts too)."""

    def __init__(self, run_dir: Path, shape: FleetShape = FleetShape(), **overrides: Any) -> None:
        self.run_dir = Path(run_dir)
        self.shape = shape
        self.hosts = Hosts(self.run_dir / "logs")
        # Unix socket paths must stay under 108 bytes: a short directory of their own.
        self._sockets = tempfile.TemporaryDirectory(prefix="mrd-")
        self.sock_dir = Path(self._sockets.name)
        try:
            spec = fleet_spec(shape)
            spec.update(overrides)
            self.regions = [r["name"] for r in spec["regions"]]
            self._build_hosts()
            self.raw = place(spec, self.hosts, shape)
            self.topology: Topology = topology_from_mapping(self.raw)
            self.config_path = self.run_dir / "topology.yaml"
            self.config_path.write_text(yaml.safe_dump(self.raw, sort_keys=False))
        except BaseException:
            self.stop()
            raise
        self.processes: dict[str, HostProcess] = {}

    def _build_hosts(self) -> None:
        h = self.hosts
        h.add_host("global")
        h.add_host("redis")
        h.link("global", "redis")
        for region in self.regions:
            h.add_host(region)
            h.link("global", region)
            # Region summaries stay in the global Redis either way (h-redis's layout).
            h.link(region, "redis")
            if self.shape.redis_per_region:
                h.add_host(f"{region}-redis")
                h.link(region, f"{region}-redis")

    def redis_host_of(self, region: str) -> str:
        return f"{region}-redis" if self.shape.redis_per_region else "redis"

    def socket(self, name: str) -> Path:
        return self.sock_dir / f"{name}.sock"

    def door(self, name: str) -> str:
        """A gRPC target for launched tier ``name`` (``global``, ``regional-eu-west``...)."""
        return f"unix:{self.socket(name)}"

    @property
    def global_target(self) -> str:
        return self.door("global")

    def redis_client(self, host: str = "redis") -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket(f"redis-{host}")), socket_timeout=5)

    def usage_records(self) -> int:
        """Usage records in the global Redis (written by the global tier, the edge)."""
        with self.redis_client() as client:
            return int(client.xlen(USAGE_STREAM))

    # ---------------------------------------------------------------- start / stop

    def _plan(self) -> list[tuple[str, str, list[str], list[tuple[str, str]]]]:
        """(name, host, argv, [(door name, address)]) bottom up."""
        cli = [sys.executable, "-m", "cli.main"]
        cfg = ["--config", str(self.config_path)]
        plan = []
        for region in self.topology.regions:
            for zone in region.zones:
                where = ["--region", region.name, "--zone", zone.name]
                gpus = [(f"gpu-{g.name}", g.endpoint.address) for g in zone.gpus]
                plan.append((f"worker-{zone.name}", region.name, [*cli, "worker", *cfg, *where],
                             gpus))  # fmt: skip
        for region in self.topology.regions:
            for zone in region.zones:
                where = ["--region", region.name, "--zone", zone.name]
                plan.append((f"local-{zone.name}", region.name, [*cli, "local", *cfg, *where],
                             [(f"local-{zone.name}", zone.endpoint.address)]))  # fmt: skip
        for region in self.topology.regions:
            plan.append((f"regional-{region.name}", region.name,
                         [*cli, "regional", *cfg, "--region", region.name],
                         [(f"regional-{region.name}", region.endpoint.address)]))  # fmt: skip
        plan.append(("global", "global", [*cli, "global", *cfg],
                     [("global", self.topology.global_tier.endpoint.address)]))  # fmt: skip
        return plan

    def start(self, timeout_s: float = 180.0) -> None:
        """Start everything at once, then wait bottom up until each tier serves and the
        global tier routes to every region. All at once: on a shared 2-core machine a
        tier process can take 20 s to import, and one layer at a time adds those up; a
        tier whose children are not up yet re-probes them until they are."""
        deadline = time.monotonic() + timeout_s
        try:
            plan = self._plan()
            self._start_doors(plan)
            for host in sorted({self.redis_host_of(r) for r in self.regions} | {"redis"}):
                self._start_redis(host, deadline)
            for name, host, argv, _ in plan:
                self.processes[name] = self.hosts.spawn(name, host, argv)
            for name, _, _, doors in plan:
                for door, _ in doors:
                    self._wait(name, lambda d=door: tier_ready(self.door(d)), deadline)
            for region in self.topology.regions:
                self._wait("global", lambda r=region: self._serves(r), deadline)
        except BaseException:
            self.stop()
            raise

    def beside(self, region: str) -> list[tuple[str, str]]:
        """Request metadata of a client standing at ``region``'s location."""
        where = self.topology.region(region).location
        return [("x-meridian-client-geo", f"{where.lat},{where.lon}")]

    def _serves(self, region: RegionConfig) -> bool:
        """True once a request from beside ``region`` is served there through the global."""
        try:
            with V2Client(self.global_target) as client:
                reply = client.infer(metadata=self.beside(region.name), timeout=5)
        except grpc.RpcError:
            return False
        return region_of(reply.route) == region.name

    def _start_doors(self, plan: list[tuple[str, str, list[str], list[tuple[str, str]]]]) -> None:
        by_host: dict[str, list[str]] = {}
        for _, host, _, doors in plan:
            by_host.setdefault(host, []).extend(f"{self.socket(d)}={a}" for d, a in doors)
        for host, maps in by_host.items():
            argv = [sys.executable, "-m", "tests.multihost.door", *maps]
            self.processes[f"door-{host}"] = self.hosts.spawn(f"door-{host}", host, argv)
        deadline = time.monotonic() + 20
        for _, _, _, doors in plan:
            for door, _ in doors:
                self._wait("door", lambda d=door: self.socket(d).exists(), deadline)

    def _start_redis(self, host: str, deadline: float) -> None:
        data = self.run_dir / f"redis-{host}"
        data.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_server_binary(),
            "--port", str(REDIS_PORT),
            "--bind", self.hosts.hosts[host].address,
            "--unixsocket", str(self.socket(f"redis-{host}")),
            "--unixsocketperm", "700",
            "--protected-mode", "no",  # its host's network holds only this fleet
            "--save", "", "--appendonly", "no",
            "--dir", str(data),
        ]  # fmt: skip
        self.processes[f"redis-{host}"] = self.hosts.spawn(f"redis-{host}", host, argv)

        def answers() -> bool:
            try:
                with self.redis_client(host) as client:
                    return bool(client.ping())
            except (redis.RedisError, OSError):
                return False

        self._wait(f"redis-{host}", answers, deadline)

    def _wait(self, name: str, ready: Any, deadline: float) -> None:
        proc = self.processes.get(name)
        while not ready():
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{name} exited at start; see {proc.log_path}")
            if time.monotonic() > deadline:
                where = proc.log_path if proc is not None else self.run_dir
                raise TimeoutError(f"{name} not ready; see {where}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.hosts.close()  # every process, top down, then the namespaces
        self._sockets.cleanup()
