"""What a topology runs in a cluster: its tier instances, GPUs, ports and names.

``build_plan`` validates the topology with the project's own loader (so a bad
file fails here as it would at a tier's start, naming the key) and lists each
tier instance with its Kubernetes name and ports, each zone's emulated GPUs
(loopback ports in the local tier's pod), and each real GPU server reached
through a Service of its own. The TLS section is validated by the pods: the
files it names exist only there (``cluster_topology``).
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cli.k8s import options as conv
from cli.k8s.names import fqdn, is_loopback, label_value, resource_name, unique
from cli.k8s.options import RenderOptions
from common.config.gpu import GpuConfig
from common.config.identity import GLOBAL, Identity, check_fleet_names, gpu_servers, local, regional
from common.config.node import ConfigError, Endpoint
from common.config.openai_edge import OpenAIEdgeConfig
from common.config.topology import Topology, ZoneConfig, topology_from_mapping

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class EmulatedGpu:
    """One emulated GPU in its zone's local tier pod (``meridian worker``)."""

    name: str
    port: int
    metrics_port: int | None


@dataclass(frozen=True)
class ExternalGpu:
    """A real GPU server outside the cluster's workloads, behind a Service of its own."""

    service: str
    gpu: str
    key: str
    host: str
    ports: tuple[tuple[str, int], ...]

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class TierInstance:
    """One tier instance: a Deployment, a Service and what goes with them."""

    key: str  # its entry in the topology: global, regions[0], regions[0].zones[1]
    kind: str  # global, regional or local
    name: str
    identity: Identity
    grpc_port: int
    ops_port: int
    region: str = ""
    zone: str = ""
    openai_port: int | None = None
    ext_proc_port: int | None = None
    # A regional tier runs in its region's zones; a local tier in its zone.
    zones: tuple[str, ...] = ()
    emulated: tuple[EmulatedGpu, ...] = ()
    # Identities whose certificates its pod mounts (its own; the zone's GPU servers').
    identities: tuple[Identity, ...] = ()


@dataclass
class Plan:
    topology: Topology
    instances: list[TierInstance] = field(default_factory=list)
    external_gpus: list[ExternalGpu] = field(default_factory=list)
    # (region, zone, gpu) index -> the GPU entry's keys in the cluster topology.
    gpu_addresses: dict[tuple[int, int, int], dict[str, str]] = field(default_factory=dict)


def _port(endpoint: Endpoint | None, default: int) -> int:
    return default if endpoint is None or endpoint.port == 0 else endpoint.port


def _openai_port(openai: OpenAIEdgeConfig | None) -> int | None:
    """The port of a tier's OpenAI HTTP (``openai_listen``; port 0: the convention's)."""
    return None if openai is None else _port(openai.endpoint, conv.OPENAI_PORT)


def _gpu_entries(raw: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key path, entry) of every GPU entry that is a mapping (the loader judges the rest)."""
    for i, region in enumerate(raw.get("regions") or []):
        zones = region.get("zones") if isinstance(region, dict) else None
        for j, zone in enumerate(zones if isinstance(zones, list) else []):
            gpus = zone.get("gpus") if isinstance(zone, dict) else None
            for k, gpu in enumerate(gpus if isinstance(gpus, list) else []):
                if isinstance(gpu, dict):
                    yield f"regions[{i}].zones[{j}].gpus[{k}]", gpu


def validate(raw: dict[str, Any], options: RenderOptions) -> Topology:
    """Parse ``raw`` as a tier would, except the TLS files (absent here unless
    ``--tls secrets``, which embeds them; in the pods they are mounted)."""
    probe = copy.deepcopy(raw)
    if options.tls == "secrets":
        if "tls" not in probe:
            raise ConfigError("--tls secrets: the topology has no tls section to take files from")
        return topology_from_mapping(probe)
    probe.pop("tls", None)
    for key, gpu in _gpu_entries(probe):
        if gpu.get("tls") is True:  # verified against the fleet's CA, which the pods mount
            if options.tls == "none":
                raise ConfigError(f"{key}.tls: true needs the fleet's CA, but --tls is none")
            gpu["tls"] = False
    topology = topology_from_mapping(probe)
    if options.tls != "none":
        check_fleet_names([(r.name, [z.name for z in r.zones]) for r in topology.regions])
    return topology


def build_plan(raw: dict[str, Any], options: RenderOptions) -> Plan:
    topology = validate(raw, options)
    plan = Plan(topology)
    glob = topology.global_tier
    plan.instances.append(
        TierInstance(
            key="global",
            kind="global",
            name=resource_name("global", key="global"),
            identity=GLOBAL,
            grpc_port=_port(glob.endpoint, conv.GRPC_PORT),
            ops_port=_port(glob.ops, conv.OPS_PORT),
            openai_port=_openai_port(glob.openai),
            identities=(GLOBAL,),
        )
    )
    for i, region in enumerate(topology.regions):
        key = f"regions[{i}]"
        zones = tuple(
            label_value(z.name, f"{key}.zones[{j}].name") for j, z in enumerate(region.zones)
        )
        plan.instances.append(
            TierInstance(
                key=key,
                kind="regional",
                name=resource_name("regional", region.name, key=f"{key}.name"),
                identity=regional(region.name),
                grpc_port=_port(region.endpoint, conv.GRPC_PORT),
                ops_port=_port(region.ops, conv.OPS_PORT),
                region=region.name,
                openai_port=_openai_port(region.openai),
                zones=zones,
                identities=(regional(region.name),),
            )
        )
        for j, zone in enumerate(region.zones):
            plan.instances.append(_zone(plan, raw, (i, j), region.name, zone, options))
    unique({i.key: i.name for i in plan.instances}, "Deployment")
    unique({g.key: g.service for g in plan.external_gpus}, "Service")
    return plan


def _zone(
    plan: Plan,
    raw: dict[str, Any],
    where: tuple[int, int],
    region: str,
    zone: ZoneConfig,
    options: RenderOptions,
) -> TierInstance:
    i, j = where
    key = f"regions[{i}].zones[{j}]"
    raw_gpus = raw["regions"][i]["zones"][j]["gpus"]
    emulated: list[EmulatedGpu] = []
    for k, gpu in enumerate(zone.gpus):
        has_metrics = "metrics_listen" in raw_gpus[k]
        if options.emulated_gpus:
            port, mport = conv.GPU_PORT_BASE + k, conv.GPU_METRICS_PORT_BASE + k
            emulated.append(EmulatedGpu(gpu.name, port, mport if has_metrics else None))
            address = {"listen": f"{LOOPBACK}:{port}"}
            if has_metrics:
                address["metrics_listen"] = f"{LOOPBACK}:{mport}"
        else:
            address = _external(plan, f"{key}.gpus[{k}]", gpu, has_metrics, raw_gpus[k], options)
        plan.gpu_addresses[(i, j, k)] = address
    identities = [local(region, zone.name)]
    if any(raw_gpus[k].get("tls") is True for k in range(len(raw_gpus))):
        identities.append(gpu_servers(region, zone.name))
    return TierInstance(
        key=key,
        kind="local",
        name=resource_name("local", zone.name, key=f"{key}.name"),
        identity=local(region, zone.name),
        grpc_port=_port(zone.endpoint, conv.GRPC_PORT),
        ops_port=_port(zone.ops, conv.OPS_PORT),
        region=region,
        zone=zone.name,
        openai_port=_openai_port(zone.openai),
        ext_proc_port=None
        if zone.ext_proc is None
        else _port(zone.ext_proc.listen, conv.EXT_PROC_PORT),
        zones=(label_value(zone.name, f"{key}.name"),),
        emulated=tuple(emulated),
        identities=tuple(identities) if options.tls != "none" else (),
    )


def _external(
    plan: Plan,
    key: str,
    gpu: GpuConfig,
    has_metrics: bool,
    raw_gpu: dict[str, Any],
    options: RenderOptions,
) -> dict[str, str]:
    """A real GPU server: checked reachable from a cluster; dialled through its Service
    (one with TLS keeps its own address, the name its certificate carries)."""
    for what, endpoint in (("listen", gpu.endpoint), ("metrics_listen", gpu.metrics_endpoint)):
        if what == "metrics_listen" and not has_metrics:
            continue
        if is_loopback(endpoint.host) or endpoint.port == 0:
            raise ConfigError(
                f"{key}.{what}: {endpoint} cannot be reached from a cluster (loopback or port "
                "0); give the GPU server's address, or render with --with-emulated-gpus"
            )
    if raw_gpu.get("tls") not in (None, False):
        out = {"listen": gpu.endpoint.address}
        if has_metrics:
            out["metrics_listen"] = gpu.metrics_endpoint.address
        return out
    service = resource_name("gpu", gpu.name, key=f"{key}.name")
    serving = "grpc" if gpu.protocol == "v2" else "http"
    ports: list[tuple[str, int]] = [(serving, gpu.endpoint.port)]
    out = {"listen": f"{fqdn(service, options.namespace)}:{gpu.endpoint.port}"}
    if has_metrics:
        metrics = gpu.metrics_endpoint
        if metrics.host == gpu.endpoint.host:
            if metrics.port != gpu.endpoint.port:
                ports.append(("metrics", metrics.port))
            out["metrics_listen"] = f"{fqdn(service, options.namespace)}:{metrics.port}"
        else:
            other = resource_name("gpu", gpu.name, "metrics", key=f"{key}.name")
            plan.external_gpus.append(
                ExternalGpu(
                    other,
                    gpu.name,
                    f"{key}.metrics_listen",
                    metrics.host,
                    (("metrics", metrics.port),),
                )
            )
            out["metrics_listen"] = f"{fqdn(other, options.namespace)}:{metrics.port}"
    plan.external_gpus.append(ExternalGpu(service, gpu.name, key, gpu.endpoint.host, tuple(ports)))
    return out
