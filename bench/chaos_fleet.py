"""The fleet under test: ``meridian up`` as a child process, and the processes it started.

The bench writes its topology (the demo fleet, the global tier on free ports, one more
tenant for the abusive streams) into a temporary run directory, starts ``python -m
cli.main up`` there (what the ``meridian`` script runs, but from this checkout), reads the
tenant keys from what ``up`` prints, and finds every process ``up`` started by walking
/proc for its children: the role (``worker-eu-west-1a``, ``local-…``, ``regional-…``,
``global``, ``redis``) comes from the command line.

A SIGKILLed process is started again by the bench with the command line and working
directory read from /proc before the kill — ``meridian up`` only prints a warning when a
child dies — unless a process of that role is already back (a launcher that restarts its
children). ``close()`` SIGCONTs whatever is stopped, stops ``up`` (which stops its own
children), then everything the bench started itself, and SIGKILLs any straggler.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis
import yaml

from bench.chaos_procs import Proc, alive, argv_of, children, cpu_seconds, redis_command, still
from cli.launcher import DEMO_FLEET, tier_ready
from cli.processes import PARENT_PID_ENV
from cli.redis_acl import FleetAcl
from common.basics.redis_url import with_credentials
from common.config.topology import Topology, load_topology
from common.operations.redis_acl import ADMIN
from sim.openai_server import gpu_probe

ROOT = Path(__file__).resolve().parent.parent
BULK_TENANT = "bulk"


def bench_fleet_spec(
    fleet_file: Path = DEMO_FLEET, *, bulk_max_concurrent: int = 2048
) -> dict[str, Any]:
    """The demo fleet with the global tier on free ports (another `make up` may hold 8001)
    and a tenant ``bulk`` whose rate limits let it open hundreds of streams; its
    ``max_concurrent`` is the caller's to choose (the unread-streams case is run with a
    tenant entitled to thousands of requests at once, and with one entitled to as many
    as the good traffic runs)."""
    spec: dict[str, Any] = yaml.safe_load(fleet_file.read_text())
    spec["global"]["listen"] = "127.0.0.1:0"
    spec["global"]["ops_listen"] = "127.0.0.1:0"
    if "openai_listen" in spec["global"]:
        spec["global"]["openai_listen"] = "127.0.0.1:0"  # and off the demo's 8000
    tenants = spec.setdefault("auth", {}).setdefault("tenants", [])
    tenants.append(
        {
            "id": BULK_TENANT,
            "api_key": "generate",
            "priority_ceiling": "standard",
            "requests_per_s": 5000,
            "tokens_per_min": 100_000_000,
            "max_concurrent": bulk_max_concurrent,
            "weight": 1.0,
        }
    )
    return spec


@dataclass
class FleetUnderTest:
    """``meridian up`` in ``run_dir`` and the processes it (or the bench) started."""

    run_dir: Path
    spec: dict[str, Any]
    up: subprocess.Popen[bytes] | None = None
    procs: dict[str, Proc] = field(default_factory=dict)
    tenant_keys: dict[str, str] = field(default_factory=dict)
    # What `up` printed for the ops HTTP's /api/* (None: auth off, none needed).
    operator_key: str | None = None
    topology: Topology | None = None
    logs: list[IO[bytes]] = field(default_factory=list)
    cpu_seen: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid: (kind, s)

    @property
    def up_log(self) -> Path:
        return self.run_dir / "up.log"

    def start(self, timeout_s: float = 180.0) -> None:
        """Start ``up`` and wait for its "ready" line; raises with the log's tail."""
        config = self.run_dir / "bench-fleet.yaml"
        config.write_text(yaml.safe_dump(self.spec, sort_keys=False))
        log = self.up_log.open("wb")
        self.logs.append(log)
        argv = [sys.executable, "-m", "cli.main", "up", "--config", str(config)]
        self.up = subprocess.Popen(
            [*argv, "--run-dir", str(self.run_dir)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},  # up dies with the bench
        )
        deadline = time.monotonic() + timeout_s
        while "ready; " not in (text := self.up_log.read_text(errors="replace")):
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"meridian up did not get ready:\n{text[-3000:]}")
            time.sleep(0.2)
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "tenant" and parts[2] == "key":
                self.tenant_keys[parts[1]] = parts[3]
            elif len(parts) >= 3 and parts[:2] == ["operator", "key"]:
                self.operator_key = parts[2]
        self.topology = load_topology(self.run_dir / "topology.yaml")
        self.procs = children(self.up.pid)
        if "redis" in self.procs:
            redis_proc = self.procs["redis"]
            redis_proc.command = redis_command(redis_proc.pid, self.admin_redis_url)

    @property
    def global_address(self) -> str:
        assert self.topology is not None
        return self.topology.global_tier.endpoint.address

    @property
    def redis_url(self) -> str:
        assert self.topology is not None
        return self.topology.redis_url

    @property
    def admin_redis_url(self) -> str:
        """The Redis URL as its admin user, for CONFIG GET (``meridian up`` runs its
        Redis with an ACL user per role and a read-only default user; the passwords are
        in ``<run_dir>/redis-acl``). Without that directory: ``redis_url`` as it is."""
        acl = FleetAcl(self.run_dir / "redis-acl")
        password_file = acl.password_file(ADMIN)
        if not password_file.is_file():
            return self.redis_url
        password = password_file.read_text().rstrip("\r\n")
        return with_credentials(self.redis_url, ADMIN, password)

    def send(self, role: str, sig: signal.Signals) -> None:
        proc = self.procs[role]
        os.kill(proc.pid, sig)

    def kill(self, role: str, sig: signal.Signals = signal.SIGKILL, wait_s: float = 15.0) -> None:
        """Send ``sig`` (SIGKILL, or SIGTERM for a graceful stop) and wait until it is gone."""
        self.sample_cpu()
        proc = self.procs[role]
        os.kill(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while alive(proc.pid):
            if time.monotonic() > deadline:
                os.kill(proc.pid, signal.SIGKILL)
            time.sleep(0.02)
        if proc.popen is not None:
            proc.popen.wait()

    def restore(self, role: str, timeout_s: float = 60.0) -> str:
        """Make ``role`` serve again after a kill; says who restarted it."""
        assert self.up is not None
        old = self.procs[role]
        back = children(self.up.pid).get(role)
        if back is not None and back.pid != old.pid:
            self.procs[role] = back
            who = "the launcher"
        else:
            log = (self.run_dir / f"{role}.restarted.log").open("ab")
            self.logs.append(log)
            env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
            popen = subprocess.Popen(
                old.command,
                cwd=old.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
            self.procs[role] = Proc(role, popen.pid, old.argv, old.cwd, old.command, popen)
            who = "the bench"
        self.wait_ready(role, timeout_s)
        new = self.procs[role]
        new.argv = argv_of(new.pid) or new.argv
        return who

    def wait_ready(self, role: str, timeout_s: float) -> None:
        """Until ``role`` serves. Should the process the bench started exit (another one,
        say the launcher's, took the port), one of the launcher's children is adopted."""
        deadline = time.monotonic() + timeout_s
        while not self.ready(role):
            proc = self.procs[role]
            if not alive(proc.pid):
                assert self.up is not None
                other = children(self.up.pid).get(role)
                if other is None:
                    raise RuntimeError(f"{role} exited after its restart; see {self.run_dir}")
                self.procs[role] = other
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role} not ready {timeout_s:.0f} s after its restart")
            time.sleep(0.02)

    def ready(self, role: str) -> bool:
        """Whether ``role`` serves: Redis answers PING, every GPU of a worker by its own
        protocol (a V2 GPU ServerReady, an OpenAI GPU ``/health``: ``gpu_probe``), a tier
        its ops ``/readyz`` (plain HTTP: no tier certificate needed to ask)."""
        topo = self.topology
        assert topo is not None
        if role == "redis":
            client = redis.Redis.from_url(topo.redis_url, socket_timeout=0.3)
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False
            finally:
                client.close()
        if role.startswith("worker-"):
            zone = role.removeprefix("worker-")
            gpus = [g for r in topo.regions for z in r.zones if z.name == zone for g in z.gpus]
            return all(tier_ready(gpu_probe(g), None, 0.3) for g in gpus)
        try:
            with urllib.request.urlopen(f"http://{self.ops_of(role)}/readyz", timeout=0.3) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):
            return False

    def ops_of(self, role: str) -> str:
        """The ops HTTP address of a regional or local tier (the bench fleet gives each one)."""
        topo = self.topology
        assert topo is not None
        kind, _, where = role.partition("-")
        for region in topo.regions:
            if kind == "regional" and where == region.name and region.ops is not None:
                return region.ops.address
            for zone in region.zones:
                if kind == "local" and where == zone.name and zone.ops is not None:
                    return zone.ops.address
        raise KeyError(f"{role} has no ops_listen in the fleet file")

    def gpu_load(self) -> dict[str, Any]:
        """The fleet's GPU slots as the global tier's ``/api/fleet`` tells them: slots held by
        the local tiers (``outstanding``), sequences the GPUs say they run, requests queued."""
        assert self.topology is not None and self.topology.global_tier.ops is not None
        url = f"http://{self.topology.global_tier.ops.address}/api/fleet"
        key = self.operator_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            ask = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(ask, timeout=5.0) as answer:
                fleet = json.load(answer)
        except (OSError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        gpus = [g for r in fleet["regions"] for z in r["zones"] for g in z["gpus"]]
        totals = fleet["totals"]
        return {
            "slots": totals["slots"],
            "held": totals["outstanding"],
            "running": sum(int(g.get("running") or 0) for g in gpus),
            "queued": totals["queued"],
        }

    def sample_cpu(self) -> dict[str, float]:
        """CPU seconds used so far by every process the fleet has had, by kind: ``router``
        (the tiers), ``gpus`` (the emulated GPUs' workers) and ``redis``. A process's last
        sample stands for it once it is gone (``kill`` samples before killing)."""
        for proc in self.procs.values():
            if still(proc):
                kind = "gpus" if proc.role.startswith("worker-") else proc.role
                kind = kind if kind in ("gpus", "redis") else "router"
                self.cpu_seen[proc.pid] = (kind, cpu_seconds(proc.pid))
        out = {"router": 0.0, "gpus": 0.0, "redis": 0.0}
        for kind, seconds in self.cpu_seen.values():
            out[kind] += seconds
        return out

    def close(self) -> None:
        """Stop everything, whatever state the run left it in."""
        for proc in self.procs.values():
            if still(proc):  # SIGCONT first: a stopped process cannot stop
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGCONT)
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGTERM)
            try:
                self.up.wait(60)
            except subprocess.TimeoutExpired:
                self.up.kill()
                self.up.wait()
        for proc in self.procs.values():
            self._stop_own(proc)
        for log in self.logs:
            log.close()

    @staticmethod
    def _stop_own(proc: Proc) -> None:
        """SIGTERM, then SIGKILL after 10 s, whoever started it (up's children are gone by
        now unless up failed to stop them)."""
        if not still(proc):
            if proc.popen is not None:
                proc.popen.wait()
            return
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while still(proc) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            if still(proc):
                os.kill(proc.pid, signal.SIGKILL)
        if proc.popen is not None:
            proc.popen.wait()
