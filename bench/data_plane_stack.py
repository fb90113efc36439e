"""Everything ``bench.data_plane`` runs at once, and the rows it measures through it.

``Stack.start`` brings up Redis, the GPUs, the tier sets (``bench.data_plane_fleet``),
the bare hops, the peers and the load generator, then checks that one request passes
through every row; ``stop`` ends every process it started, however the run ended.
Placement (``pin``, once every process serves): the load generator and the GPU worker
process share core 0, every data plane under test (tiers, hops, peers, Redis) core 1, so
rows compare what a data plane does with one core; the ``--workers 2`` row gets both.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.data_plane_fleet import (
    MODEL,
    REGION,
    Credentials,
    Proc,
    TierSet,
    WorkersFlag,
    base_mapping,
    gpu_addresses,
    identity_files,
    issue_pki,
    pin,
    set_mapping,
    tier_argv,
    tier_ready_as,
    wait_until,
    write_yaml,
)
from bench.data_plane_peers import PeerTls, plan, write_files
from cli.readiness import tier_ready
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.identity import regional
from common.config.node import Endpoint, parse_endpoint
from common.tenancy.auth import new_key

BENCH_ROOT = Path(__file__).resolve().parent.parent
PEERS = ("nginx", "haproxy", "envoy")
COMPARED = " [compared]"  # the rows of --compare's checkout
# Chains through the other tier sets, each differing from ``chain`` in one thing.
CHAIN_VARIANTS = {
    "plain": "chain, TLS off",
    "untraced": "chain, tracing off",
    "twin": "chain, second set",
}
# Connections the driver opens to a --workers tier: the kernel spreads connections, not
# calls, over the workers (bench.workers measures 1 worker at as many too).
WORKER_CONNECTIONS = 16


@dataclass(frozen=True)
class Row:
    """One way through to the GPUs: where the driver sends, as whom, what CPU counts."""

    name: str
    targets: tuple[str, ...]
    path: tuple[str, ...]  # processes whose CPU is the row's (the driver's is added)
    creds: Credentials | None = None
    api_key: bool = False
    connections: int = 1  # per target (data_plane_load.Job.connections)


@dataclass
class Stack:
    workdir: Path
    checkout: Path
    gpus: int = 4
    time_scale: float = 0.001
    pin: bool = True
    peers: tuple[str, ...] = PEERS
    # Another checkout whose tiers run beside these (set ``cmp``): before/after in one run.
    compare: Path | None = None
    # A second tier set configured as the first (``twin``) with its own chain row: how far
    # two identical chains differ in one run, the floor under the tracing and TLS rows.
    twin: bool = False
    procs: dict[str, Proc] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # row -> why not measured

    def __post_init__(self) -> None:
        two = self.pin and (os.cpu_count() or 1) >= 2
        self.driver_cpus = frozenset({0}) if two else frozenset()
        self.router_cpus = frozenset({1}) if two else frozenset()
        self.redis = EmbeddedRedis()
        self.api_key, digest = new_key()
        self._digest = digest
        self.sets: dict[str, TierSet] = {}

    # --- processes ---------------------------------------------------------------

    def _proc(self, name: str, argv: list[str], cpus: frozenset[int], **kw: Any) -> Proc:
        proc = Proc(name, argv, self.workdir / f"{name}.log", cpus, **kw)
        self.procs[name] = proc
        proc.start()
        return proc

    def _code_env(self, checkout: Path | None = None) -> dict[str, Any]:
        """Run the checkout under test: its directory first on the path."""
        where = checkout or self.checkout
        return {"env": {"PYTHONPATH": str(where)}, "cwd": where}

    def _bench_env(self) -> dict[str, Any]:
        return {"env": {"PYTHONPATH": str(BENCH_ROOT)}, "cwd": BENCH_ROOT}

    def start(self) -> None:
        """Spawn every process, then wait until each serves (GPUs first)."""
        workers_flag = WorkersFlag(self.checkout)  # asks while the rest starts
        self.redis.start()
        assert self.redis.process is not None
        self.redis_pid = self.redis.process.pid
        base = base_mapping(self.redis.url, self.gpus, self.time_scale, self._digest)
        self.gpu_list = gpu_addresses(base)
        self.tls = issue_pki(self.workdir / "pki", base)
        config = write_yaml(self.workdir / "gpus.yaml", base)
        argv = tier_argv("worker", config, ["--time-scale", str(self.time_scale)])
        worker = self._proc("gpus", argv, self.driver_cpus, **self._code_env())
        self._pending = [(f"GPU {g}", worker, partial(tier_ready, g)) for g in self.gpu_list]
        self._start_sets(base, workers_flag.answer())
        self._start_hops()
        self._start_peers()
        argv = [sys.executable, "-m", "bench.data_plane_load"]
        self.driver = self._proc("driver", argv, self.driver_cpus, pipes=True, **self._bench_env())
        for what, proc, ready in self._pending:
            wait_until(what, proc, ready, 90)
        if self.read() != "ready":
            raise RuntimeError(f"load driver did not start: {self.driver.tail()}")
        for proc in self.procs.values():
            pin(proc.pid, proc.cpus)
        pin(self.redis_pid, self.router_cpus)
        self._rows()

    def _start_sets(self, base: dict[str, Any], workers: bool) -> None:
        every = ("local", "regional", "global")
        specs: list[tuple[str, dict[str, Any] | None, dict[str, str], tuple[str, ...]]] = [
            ("tls", self.tls, {}, every),
            ("plain", None, {}, every),
            ("untraced", self.tls, {"OTEL_SDK_DISABLED": "true"}, every),
        ]
        if self.compare is not None:
            specs.append(("cmp", self.tls, {}, every))
        if self.twin:
            specs.append(("twin", self.tls, {}, every))
        if workers:
            specs.append(("workers", self.tls, {}, ("local",)))
        else:
            self.unavailable["local --workers 2"] = (
                "not available: `meridian local --help` of the code under test has no --workers"
            )
        for db, (name, tls, env, tiers) in enumerate(specs, start=1):
            mapping = set_mapping(base, db, tls)
            config = write_yaml(self.workdir / f"{name}.yaml", mapping)
            tier_set = TierSet(name, config, mapping, env, tls)
            self.sets[name] = tier_set
            for tier in tiers:
                extra = ["--workers", "2"] if name == "workers" else []
                cpus = frozenset() if name == "workers" else self.router_cpus
                code = self._code_env(self.compare if name == "cmp" else None)
                code["env"] = {**code["env"], **env}
                proc = self._proc(f"{name}-{tier}", tier_argv(tier, config, extra), cpus, **code)
                tier_set.procs[tier] = proc
                ready = partial(tier_ready_as, tier_set.address(tier), tier_set.caller(tier))
                self._pending.append((f"{proc.name} on {tier_set.address(tier)}", proc, ready))

    def _hop(self, name: str, upstream: list[str], serve: bool, up: bool) -> str:
        listen = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "bench.data_plane_hop", "--listen", listen,
                "--upstream", ",".join(upstream)]  # fmt: skip
        files = self.peer_files()
        if serve or up:
            argv += ["--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key]
        argv += ["--tls-serve"] * serve + ["--tls-upstream"] * up
        proc = self._proc(name, argv, self.router_cpus, **self._bench_env())
        ready = partial(tier_ready_as, listen, files if serve else None)
        self._pending.append((name, proc, ready))
        return listen

    def peer_files(self) -> Credentials:
        """The certificate hops and peers serve and the driver presents to them: the
        regional tier's (any the fleet CA signed would do: they check the CA only)."""
        return identity_files(self.tls, regional(REGION))

    def _start_hops(self) -> None:
        # Alone: mutual TLS to the caller, plaintext to the GPUs (as the local tier).
        self.hop = self._hop("hop", self.gpu_list, serve=True, up=False)
        # In series, as the chain: plaintext edge, TLS between hops, plaintext to GPUs.
        c = self._hop("hop3-c", self.gpu_list, serve=True, up=False)
        b = self._hop("hop3-b", [c], serve=True, up=True)
        self.hop3 = self._hop("hop3-a", [b], serve=False, up=True)

    def _start_peers(self) -> None:
        files = self.peer_files()
        peer_tls = PeerTls(files.ca, files.cert, files.key)
        gpus = [parse_endpoint(g, "gpus") for g in self.gpu_list]
        self.peer_address: dict[str, str] = {}
        for name in self.peers:
            listen = Endpoint("127.0.0.1", free_port())
            admin = Endpoint("127.0.0.1", free_port())
            workdir = self.workdir / name
            peer = plan(name, workdir, listen, gpus, peer_tls, admin)
            if peer is None:
                how = "make envoy" if name == "envoy" else "make peers"
                self.unavailable[name] = f"not available: no {name} binary (`{how}`)"
                continue
            write_files(peer, workdir)
            proc = self._proc(name, peer.argv, self.router_cpus)
            self._pending.append((name, proc, partial(tier_ready_as, listen.address, files)))
            self.peer_address[name] = listen.address

    def _tier_rows(self, name: str, tag: str) -> list[Row]:
        """local, regional+local and chain through tier set ``name``."""
        t, meridian = self.sets[name], ("gpus", "redis")
        return [
            Row(f"local{tag}", (t.address("local"),), (f"{name}-local", *meridian),
                t.caller("local")),
            Row(f"regional+local{tag}", (t.address("regional"),),
                (f"{name}-regional", f"{name}-local", *meridian), t.caller("regional")),
            Row(f"chain{tag}", (t.address("global"),),
                (f"{name}-global", f"{name}-regional", f"{name}-local", *meridian), None, True),
        ]  # fmt: skip

    def _rows(self) -> None:
        gpus = ("gpus",)
        meridian = ("gpus", "redis")
        self.rows = [
            Row("direct", tuple(self.gpu_list), gpus),
            Row("bare hop", (self.hop,), ("hop", *gpus), self.peer_files()),
            *self._tier_rows("tls", ""),
            Row("3 bare hops", (self.hop3,), ("hop3-a", "hop3-b", "hop3-c", *gpus)),
        ]
        if "cmp" in self.sets:
            self.rows += self._tier_rows("cmp", COMPARED)
        for name, address in self.peer_address.items():
            self.rows.append(Row(name, (address,), (name, *gpus), self.peer_files()))
        if "workers" in self.sets:
            w = self.sets["workers"]
            self.rows.append(
                Row(
                    "local --workers 2",
                    (w.address("local"),),
                    ("workers-local", *meridian),
                    w.caller("local"),
                    connections=WORKER_CONNECTIONS,
                )
            )
        for name, label in CHAIN_VARIANTS.items():
            if name not in self.sets:
                continue
            s = self.sets[name]
            path = (f"{name}-global", f"{name}-regional", f"{name}-local", *meridian)
            self.rows.append(Row(label, (s.address("global"),), path, None, True))

    # --- the driver --------------------------------------------------------------

    def job(
        self, row: Row, mode: str, seconds: float, warmup_s: float, concurrency: int
    ) -> dict[str, Any]:
        job: dict[str, Any] = {
            "targets": list(row.targets), "mode": mode, "model": MODEL, "concurrency": concurrency,
            "seconds": seconds, "warmup_s": warmup_s,
            "api_key": self.api_key if row.api_key else "",
            "connections": row.connections,
        }  # fmt: skip
        if row.creds is not None:
            job.update(tls_ca=row.creds.ca, tls_cert=row.creds.cert, tls_key=row.creds.key)
        return job

    def send(self, job: dict[str, Any]) -> None:
        """Hand the driver one job; ``read`` then gives ``begin``, ``end`` and the result."""
        process = self.driver.process
        assert process is not None and process.stdin is not None
        process.stdin.write(json.dumps(job) + "\n")
        process.stdin.flush()

    def read(self) -> str:
        process = self.driver.process
        assert process is not None and process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"load driver exited: {self.driver.tail()}")
        return line.strip()

    def stop(self) -> None:
        """Every process (all asked at once, then each waited for), then Redis."""
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.stop()
        self.redis.close()

    def pids(self, row: Row) -> dict[str, int]:
        procs = {name: proc.pid for name, proc in self.procs.items()}
        out = {name: self.redis_pid if name == "redis" else procs[name] for name in row.path}
        out["driver"] = self.driver.pid
        return out
