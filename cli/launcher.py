"""Start a whole fleet on one machine, one OS process per tier instance.

``Fleet`` is what ``meridian up`` runs and what the end-to-end tests use:
an embedded Redis, the emulated GPUs of each zone (one process per zone),
a local tier per zone, a regional tier per region and the global tier, each
its own process so that killing one is a real failure. Port 0 in the fleet
file is resolved to a free loopback port first, and the resolved topology is
written beside the logs for every process to read. Each child asks the kernel
to end it when the launcher dies (PR_SET_PDEATHSIG, set by the child at start),
so even a killed launcher leaves no process behind; the embedded Redis asks the
same through a small wrapper (``common.basics.redis_embed``) and keeps its
append-only file in ``<run_dir>/redis``, so a Redis restart, or a second
``meridian up`` on the same run directory, finds every usage record again.
The embedded Redis runs with an ACL user per role and each tier logs in as its
own (``cli.redis_acl.FleetAcl``: passwords in ``<run_dir>/redis-acl``).
``ExitWatch`` (``cli.processes``) reports a process that died once, and once when it is back.
With ``tls`` (the default) a fresh PKI is generated into ``<run_dir>/pki``, one
certificate per tier instance (``common.config.pki``), and the tiers talk
mutual TLS, each serving only its parent (see ``common.config.tls``); the
global endpoint stays plaintext for clients.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import yaml

from cli.processes import ExitWatch, TierProcess
from cli.readiness import tier_ready
from cli.redis_acl import FleetAcl
from cli.region_redis import embed_region_redises
from common.basics.redis_embed import EmbeddedRedis, free_port
from common.config.identity import GLOBAL, Identity, local, regional
from common.config.pki import FleetCA
from common.config.tls import GpuCredentials, TierTls, fleet_hosts, fleet_identities, tier_tls
from common.config.topology import (
    GlobalConfig,
    RegionConfig,
    Topology,
    ZoneConfig,
    topology_from_mapping,
)
from common.operations.redis_acl import user_name
from common.tenancy.auth import new_key
from sim.openai_server import gpu_probe

DEMO_FLEET = Path(__file__).resolve().parent.parent / "deploy" / "demo-fleet.yaml"
# A fleet's processes by name prefix, bottom up: started in this order, stopped in reverse.
LAYERS = ("worker-", "local-", "regional-", "global")


LISTEN_KEYS = frozenset({"listen", "metrics_listen", "ops_listen", "openai_listen"})  # binds


def resolve_ports(raw: dict[str, Any]) -> dict[str, Any]:
    """Replace every ``host:0`` listen address with a free loopback port."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                if key in LISTEN_KEYS and isinstance(value, str):
                    host, _, port = value.rpartition(":")
                    if port == "0":
                        value = f"{host}:{free_port(host.strip('[]'))}"
                out[key] = walk(value)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    resolved: dict[str, Any] = walk(raw)
    return resolved


def generate_tenant_keys(raw: dict[str, Any]) -> dict[str, str]:
    """Replace each tenant's ``api_key: generate`` with a fresh key's SHA-256.

    Returns the keys by tenant id: the only place they exist (print them once).
    """
    keys: dict[str, str] = {}
    for tenant in (raw.get("auth") or {}).get("tenants") or []:
        if tenant.get("api_key") == "generate":
            del tenant["api_key"]
            key, digest = new_key()
            tenant.setdefault("api_key_sha256", []).append(digest)
            keys[str(tenant.get("id"))] = key
    return keys


def generate_admin_key(raw: dict[str, Any]) -> str | None:
    """Replace ``auth.admin_key: generate`` with a fresh key's SHA-256 in
    ``auth.admin_keys``; return the key (print it once), or None."""
    return _generate_auth_key(raw, "admin_key", "admin_keys")


def generate_operator_key(raw: dict[str, Any]) -> str | None:
    """Replace ``auth.operator_key: generate`` with a fresh key's SHA-256 in
    ``auth.operator_key_sha256`` (the ops HTTP's /api/*); return the key, or None.

    With ``auth.enabled`` on and no operator key in the file, one is made as if
    asked for: without it nobody could read the dashboard of the fleet this starts."""
    auth = raw.get("auth") or {}
    if auth.get("enabled") is True and "operator_key" not in auth:
        if "operator_key_sha256" not in auth:
            auth["operator_key"] = "generate"
    return _generate_auth_key(raw, "operator_key", "operator_key_sha256")


def _generate_auth_key(raw: dict[str, Any], directive: str, digests: str) -> str | None:
    auth = raw.get("auth") or {}
    if auth.get(directive) != "generate":
        return None
    del auth[directive]
    key, digest = new_key()
    auth.setdefault(digests, []).append(digest)
    return key


class Fleet:
    """A whole Meridian deployment on this machine; ``start()`` / ``stop()``.

    ``tls=True`` generates a PKI into ``<run_dir>/pki`` (a CA and one certificate
    per tier instance) and sets the topology's ``tls`` (``client_facing`` False)
    unless the fleet file has its own ``tls`` section; ``tls=False`` runs
    plaintext everywhere, dropping any such section. An inner tier then serves
    only its parent: ``credentials_for(name)`` presents the parent's certificate,
    ``credentials_as(identity)`` any instance's.
    """

    def __init__(
        self,
        fleet_file: Path | str = DEMO_FLEET,
        run_dir: Path | str = "run",
        *,
        overrides: dict[str, Any] | None = None,
        redis_url: str | None = None,
        policy: str = "default",
        tls: bool = True,
    ) -> None:
        self.policy = policy
        raw = yaml.safe_load(Path(fleet_file).read_text())
        raw.update(overrides or {})
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # An embedded Redis runs with an ACL user per role (cli.redis_acl.FleetAcl).
        self.acl = None if redis_url else FleetAcl(self.run_dir / "redis-acl")
        acl_file = self.acl.acl_file if self.acl else None
        self.redis = (
            None if redis_url else EmbeddedRedis(data_dir=self.run_dir / "redis", acl_file=acl_file)
        )
        raw["redis_url"] = redis_url or self.redis.address_url  # type: ignore[union-attr]
        # Regions whose entry says ``redis_url: embedded`` get their own (cli.region_redis).
        self.region_redis = embed_region_redises(raw, self.run_dir, acl_file)
        ca = None
        if not tls:
            raw.pop("tls", None)
        elif "tls" not in raw:
            # The CA now (the topology names its files); the instances' certificates
            # once the parsed topology says which instances there are.
            ca = FleetCA.create(self.run_dir / "pki")
            raw["tls"] = {"ca": ca.tls.ca, "certs": ca.tls.certs, "client_facing": False}
        self.tenant_keys = generate_tenant_keys(raw)
        self.admin_key = generate_admin_key(raw)
        self.operator_key = generate_operator_key(raw)
        self.raw = resolve_ports(raw)
        self.topology: Topology = topology_from_mapping(self.raw)
        if ca is not None:
            ca.issue(fleet_identities(self.topology), hosts=fleet_hosts(self.topology))
        if self.acl is not None:
            self.acl.write(self.topology)
        self._credentials: dict[Identity, grpc.ChannelCredentials] = {}
        self.config_path = self.run_dir / "topology.yaml"
        self.config_path.write_text(yaml.safe_dump(self.raw, sort_keys=False))
        self.processes: dict[str, TierProcess] = {}
        for name, argv in self._plan():
            self.processes[name] = TierProcess(name, argv, self.run_dir / f"{name}.log")
        self.watch = ExitWatch(self.processes, self.answers)

    def _plan(self) -> Iterator[tuple[str, list[str]]]:
        cli = [sys.executable, "-m", "cli.main"]
        cfg = ["--config", str(self.config_path)]
        for region in self.topology.regions:
            for zone in region.zones:
                where = ["--region", region.name, "--zone", zone.name]
                yield f"worker-{zone.name}", [*cli, "worker", *cfg, *where]
                policy = ["--policy", self.policy, *self._login(local(region.name, zone.name))]
                yield f"local-{zone.name}", [*cli, "local", *cfg, *where, *policy]
        for region in self.topology.regions:
            where = ["--region", region.name, *self._login(regional(region.name))]
            yield f"regional-{region.name}", [*cli, "regional", *cfg, *where]
        yield "global", [*cli, "global", *cfg, *self._login(GLOBAL)]

    def _login(self, identity: Identity) -> list[str]:
        """The option that makes a tier log in to Redis as its own ACL user."""
        if self.acl is None:
            return []
        return ["--redis-password-file", str(self.acl.password_file(user_name(identity)))]

    def endpoint_of(self, name: str) -> str:
        """The gRPC address of a launched tier process (``global``, ``regional-eu-west`` ...)."""
        return self._entry_of(name).endpoint.address

    def openai_url_of(self, name: str) -> str | None:
        """The OpenAI HTTP base URL (``http://HOST:PORT/v1``, port 0 resolved) of launched
        tier ``name`` (``global``, ``regional-<region>``, ``local-<zone>``); None when its
        entry has no ``openai_listen``. The same address is in ``config_path``'s file."""
        openai = self._entry_of(name).openai
        return None if openai is None else openai.base_url

    def _entry_of(self, name: str) -> GlobalConfig | RegionConfig | ZoneConfig:
        """The topology entry of launched tier process ``name`` (KeyError: none)."""
        topo = self.topology
        if name == "global":
            return topo.global_tier
        kind, _, where = name.partition("-")
        for region in topo.regions:
            if kind == "regional" and where == region.name:
                return region
            for zone in region.zones:
                if kind == "local" and where == zone.name:
                    return zone
        raise KeyError(name)

    def identity_of(self, name: str) -> Identity | None:
        """The identity of launched tier ``name`` (None for the global tier and workers)."""
        kind, _, where = name.partition("-")
        for region in self.topology.regions:
            if kind == "regional" and where == region.name:
                return regional(region.name)
            for zone in region.zones:
                if kind == "local" and where == zone.name:
                    return local(region.name, zone.name)
        return None

    def credentials_as(self, identity: Identity) -> grpc.ChannelCredentials:
        """Channel credentials presenting ``identity``'s certificate (fleet on TLS only)."""
        if self.topology.tls is None:
            raise ValueError("this fleet runs without TLS: there are no identities")
        if identity not in self._credentials:
            keys = TierTls.load(self.topology.tls, identity)
            self._credentials[identity] = keys.channel_credentials()
        return self._credentials[identity]

    def credentials_for(self, name: str) -> grpc.ChannelCredentials | None:
        """How to call launched process ``name``: None (plaintext) for GPU workers
        (a GPU with ``tls``: ``_probes``), for the global tier unless its endpoint
        is client-facing TLS, and for every tier when the fleet runs without TLS;
        else as its parent, the only caller an inner tier serves."""
        tls = self.topology.tls
        if tls is None or name.startswith("worker-"):
            return None
        if name == "global":
            ca = Path(tls.ca).read_bytes()
            return grpc.ssl_channel_credentials(ca) if tls.client_facing else None
        identity = self.identity_of(name)
        if identity is None or identity.parent is None:
            raise KeyError(name)
        return self.credentials_as(identity.parent)

    @property
    def global_address(self) -> str:
        return self.topology.global_tier.endpoint.address

    @property
    def openai_url(self) -> str | None:
        """The global tier's OpenAI HTTP base URL (``openai_url_of("global")``)."""
        return self.openai_url_of("global")

    def start(self, timeout_s: float = 60.0) -> None:
        """Start bottom-up, a layer at a time, so each tier's first health probe
        finds its children already serving. Every process is launched at once and
        loads its code meanwhile (about a second of CPU each), each layer behind a
        gate opened when the layer below serves."""
        if self.redis is not None:
            self.redis.start()
        deadline = time.monotonic() + timeout_s
        gates: list[int] = []  # each layer's write end: closing it opens the gate
        try:
            for server in self.region_redis.values():
                server.start()
            for layer in LAYERS:
                read, write = os.pipe()  # not inheritable: only pass_fds passes `read`
                gates.append(write)
                try:
                    for proc in self._layer(layer):
                        proc.start(gate=read)
                finally:
                    os.close(read)
            for layer in LAYERS:
                os.close(gates.pop(0))
                for proc in self._layer(layer):
                    self._wait_ready(proc, deadline)
        except BaseException:
            try:
                self.stop()  # a process still at its gate dies of SIGTERM there
            finally:
                for write in gates:
                    os.close(write)
            raise

    def _wait_ready(self, proc: TierProcess, deadline: float) -> None:
        """Until ``proc`` serves: ServerReady=true for tiers, every GPU port for workers."""
        for address, credentials in self._probes(proc.name):
            while not tier_ready(address, credentials):
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited at start; see {proc.log_path}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name} not ready on {address}; see {proc.log_path}")
                time.sleep(0.05)

    def _probes(self, name: str) -> list[tuple[str, grpc.ChannelCredentials | None]]:
        """Where ``name`` serves and how to call it there: a worker's every GPU port
        (each dialled as its local tier does), a tier's endpoint."""
        if not name.startswith("worker-"):
            return [(self.endpoint_of(name), self.credentials_for(name))]
        zone = name.removeprefix("worker-")
        probes: list[tuple[str, grpc.ChannelCredentials | None]] = []
        for region in self.topology.regions:
            for z in region.zones:
                if z.name == zone:
                    dial = GpuCredentials(tier_tls(self.topology, local(region.name, zone)))
                    probes += [(gpu_probe(g), dial(g)) for g in z.gpus]
        return probes

    def answers(self, name: str) -> bool:
        """True when every address of launched process ``name`` serves (ServerReady)."""
        return all(tier_ready(a, credentials, 0.2) for a, credentials in self._probes(name))

    def kill(self, name: str) -> None:
        """Kill one tier process outright (SIGKILL), as a crash would."""
        self.processes[name].stop(signal.SIGKILL)

    def restart(self, name: str, timeout_s: float = 30.0) -> None:
        proc = self.processes[name]
        proc.stop()
        proc.start()
        self._wait_ready(proc, time.monotonic() + timeout_s)

    def _layer(self, prefix: str) -> list[TierProcess]:
        return [p for n, p in self.processes.items() if n.startswith(prefix)]

    def stop(self) -> None:
        # Top down, so upper tiers stop sending before the ones below go away; a
        # layer's processes stop together (each drains for about half a second).
        for layer in reversed(LAYERS):
            stopping = self._layer(layer)
            for proc in stopping:
                proc.send_signal()
            for proc in stopping:
                proc.stop(sig=None)  # signalled above: only wait
        if self.redis is not None:
            self.redis.close()
        for server in self.region_redis.values():
            server.close()
