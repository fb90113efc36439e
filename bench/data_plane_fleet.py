"""The processes ``bench.data_plane`` measures, each an OS process of its own.

One embedded Redis; one ``meridian worker`` process serving the emulated GPUs every row
shares; *tier sets*, each a topology of its own over those same GPUs (its own tier
ports and Redis database, so their capacity streams and quotas never mix): ``tls`` (the
launcher's mutual TLS between tiers, tenant auth at the edge, tracing at Meridian's
default sampler), ``plain`` (TLS off), ``untraced`` (``OTEL_SDK_DISABLED=true``) and
``workers`` (the local tier with ``--workers 2``, when the code under test has the
flag); bare hops; nginx, HAProxy and Envoy. Tier processes run the code of
``checkout`` (their working directory and ``PYTHONPATH``), so the bench measures any
branch. Every process is started with ``PR_SET_PDEATHSIG``, pinned (``pin``) once it serves,
and ``stop`` ends each one.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.data_plane_load import descendants
from cli.readiness import tier_ready
from common.basics.processes import stop_process
from common.basics.redis_embed import free_port
from common.config.identity import GLOBAL, Identity, regional
from common.config.pki import FleetCA
from common.config.tls import fleet_identities
from common.config.topology import topology_from_mapping
from sim.topology import one_zone_mapping

REGION, ZONE, MODEL = "r", "r-1a", "m"
# Fork, then in a fresh interpreter: die with the bench, exec.
_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def pin(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of ``pid`` and of the processes below it onto ``cpus`` (threads
    made later inherit their maker's). Done once a process serves, so that start-up
    (imports, mostly) uses every core."""
    if not cpus:
        return
    for process in descendants(pid):
        try:
            tasks = [int(t.name) for t in Path(f"/proc/{process}/task").iterdir()]
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(task, cpus)


@dataclass
class Proc:
    """One process the bench started: ``start`` spawns it, ``stop`` ends it."""

    name: str
    argv: list[str]
    log: Path
    cpus: frozenset[int] = frozenset()  # where it runs once it serves; empty: every core
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    pipes: bool = False  # stdin and stdout are the bench's (text lines), stderr the log
    process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        wrapped = [sys.executable, "-I", "-S", "-c", _EXEC, str(os.getpid()), *self.argv]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                wrapped,
                stdin=subprocess.PIPE if self.pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.pipes else out,
                stderr=out if self.pipes else subprocess.STDOUT,
                env={**os.environ, **self.env}, cwd=self.cwd, text=True, bufsize=1,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} not started"
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        """Ask it to stop (``stop`` waits); several at once stop in parallel."""
        if self.process is None or self.process.poll() is not None:
            return
        if self.process.stdin is not None:
            self.process.stdin.close()  # the driver ends at the end of its input
        self.process.terminate()

    def stop(self) -> None:
        self.terminate()
        process, self.process = self.process, None
        stop_process(process, sig=None)  # signalled above (and its input closed)


def wait_until(what: str, proc: Proc, ready: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited at start: {proc.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready within {timeout_s} s: {proc.tail()}")
        time.sleep(0.1)


@dataclass(frozen=True)
class Credentials:
    """Files a caller presents (mutual TLS), as the loadgen's Job fields take them."""

    ca: str
    cert: str
    key: str

    def channel(self) -> grpc.ChannelCredentials:
        ca, cert, key = (Path(p).read_bytes() for p in (self.ca, self.cert, self.key))
        return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)


def base_mapping(redis_url: str, gpus: int, time_scale: float, key_sha256: str) -> dict[str, Any]:
    """The ``tls`` set's topology: one region, one zone of ``gpus`` A100s, auth on."""
    mapping = one_zone_mapping(
        redis_url, gpus=gpus, model=MODEL, region=REGION, zone=ZONE,
        global_listen=f"127.0.0.1:{free_port()}", region_listen=f"127.0.0.1:{free_port()}",
        health_interval_s=1.0, summary_cadence_s=1.0, slow_start_window_s=0,
        time_scale=time_scale,
    )  # fmt: skip
    # The edge authenticates every call and applies the tenant's limits, set high enough
    # never to refuse: their cost is measured, not their effect.
    tenant = {
        "id": "bench", "api_key_sha256": [key_sha256], "priority_ceiling": "critical",
        "requests_per_s": 1e6, "tokens_per_min": 1e9, "max_concurrent": 4096,
    }  # fmt: skip
    mapping["auth"] = {"enabled": True, "tenants": [tenant]}
    return mapping


def set_mapping(base: dict[str, Any], db: int, tls: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``base`` with fresh tier ports, Redis database ``db`` and ``tls``."""
    out = copy.deepcopy(base)
    out["redis_url"] = out["redis_url"].rsplit("/", 1)[0] + f"/{db}"
    out["global"]["listen"] = f"127.0.0.1:{free_port()}"
    region = out["regions"][0]
    region["listen"] = f"127.0.0.1:{free_port()}"
    region["zones"][0]["listen"] = f"127.0.0.1:{free_port()}"
    out.pop("tls", None)
    if tls is not None:
        out["tls"] = tls
    return out


@dataclass
class TierSet:
    """The tiers of one topology: their addresses and how a caller dials each."""

    name: str
    config: Path
    mapping: dict[str, Any]
    env: dict[str, str]
    tls: dict[str, Any] | None
    procs: dict[str, Proc] = field(default_factory=dict)

    def address(self, tier: str) -> str:
        region = self.mapping["regions"][0]
        node = {"global": self.mapping["global"], "regional": region, "local": region["zones"][0]}
        return str(node[tier]["listen"])

    def caller(self, tier: str) -> Credentials | None:
        """An inner tier serves only its parent: present the parent's certificate."""
        if self.tls is None or tier == "global":
            return None
        return identity_files(self.tls, GLOBAL if tier == "regional" else regional(REGION))


def issue_pki(directory: Path, mapping: dict[str, Any]) -> dict[str, Any]:
    ca = FleetCA.create(directory)
    tls = {"ca": ca.tls.ca, "certs": ca.tls.certs, "client_facing": False}
    ca.issue(fleet_identities(topology_from_mapping({**mapping, "tls": tls})))
    return tls


def tier_argv(tier: str, config: Path, extra: list[str]) -> list[str]:
    zone = ["--region", REGION, "--zone", ZONE]
    where = {"global": [], "regional": ["--region", REGION], "local": zone, "worker": zone}
    # A short grace: at the end nothing is in flight but the tiers' health watches.
    grace = [] if tier == "worker" else ["--grace", "0.5"]
    argv = [sys.executable, "-m", "cli.main", tier, "--config", str(config), *where[tier]]
    return [*argv, *grace, *extra]


def gpu_addresses(mapping: dict[str, Any]) -> list[str]:
    return [str(g["listen"]) for g in mapping["regions"][0]["zones"][0]["gpus"]]


class WorkersFlag:
    """Whether the code under test knows ``meridian local --workers`` (h-workers' seam):
    asks its ``--help`` in the background; ``answer`` waits for it."""

    def __init__(self, checkout: Path) -> None:
        self._help = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "local", "--help"], cwd=checkout,
            env={**os.environ, "PYTHONPATH": str(checkout)},
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def answer(self) -> bool:
        try:
            out, _ = self._help.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._help.kill()
            self._help.communicate()
            return False
        return b"--workers" in out


def identity_files(tls: dict[str, Any], identity: Identity) -> Credentials:
    certs = Path(tls["certs"], *identity.path)
    return Credentials(tls["ca"], str(certs / "cert.pem"), str(certs / "key.pem"))


def write_yaml(path: Path, mapping: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(mapping, sort_keys=False))
    return path


def tier_ready_as(address: str, creds: Credentials | None) -> bool:
    return tier_ready(address, None if creds is None else creds.channel())
