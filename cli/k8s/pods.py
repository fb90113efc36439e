"""The pod of a tier instance: its container, probes, volumes and placement.

Probes: readiness is the tier's own grpc.health.v1 status (SERVING while it has
a healthy child; NOT_SERVING from the moment it receives SIGTERM), asked by the
kubelet's native gRPC probe. The kubelet's gRPC probe speaks plaintext only, so
a tier serving TLS (every inner tier of a fleet on mutual TLS) is asked the
same condition over its ops HTTP (``/readyz``). Liveness is the ops HTTP's
``/healthz``, which answers while the process runs: grpc.health.v1 serves only
the has-a-healthy-child status, and a liveness probe on it would restart every
tier whose children are down, turning an outage below into restarts above.

Emulated GPUs (``meridian worker``) run as a native sidecar of their zone's
local tier (an init container that keeps running): started before the tier,
stopped after it, so in-flight calls finish against GPUs that still serve.
"""

from __future__ import annotations

from typing import Any

from cli.k8s import options as conv
from cli.k8s.names import HOST_KEY, ZONE_KEY
from cli.k8s.options import RenderOptions
from cli.k8s.plan import TierInstance
from common.config.identity import Identity
from common.request.server import V2_SERVICE

CONFIG_MAP = "meridian-topology"
AUTH_SECRET = "meridian-auth"

_RESOURCES = {
    "global": ({"cpu": "500m", "memory": "256Mi"}, {"cpu": "2", "memory": "1Gi"}),
    "regional": ({"cpu": "250m", "memory": "256Mi"}, {"cpu": "1", "memory": "512Mi"}),
    "local": ({"cpu": "500m", "memory": "256Mi"}, {"cpu": "2", "memory": "1Gi"}),
    "gpus": ({"cpu": "250m", "memory": "128Mi"}, {"cpu": "1", "memory": "512Mi"}),
}


def tls_secret(identity: Identity) -> str:
    """The Secret holding ``identity``'s certificate (``meridian-tls-regional-eu-west``)."""
    return "-".join(("meridian-tls", *(p.lower() for p in identity.path)))


def serves_tls(instance: TierInstance, options: RenderOptions, client_facing: bool) -> bool:
    if options.tls == "none":
        return False
    return instance.kind != "global" or client_facing


def _probes(instance: TierInstance, tls: bool) -> dict[str, Any]:
    if tls:
        ready: dict[str, Any] = {"httpGet": {"path": "/readyz", "port": "ops"}}
    else:
        ready = {"grpc": {"port": instance.grpc_port, "service": V2_SERVICE}}
    return {
        "readinessProbe": {**ready, "periodSeconds": 2, "timeoutSeconds": 1, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "ops"},
            "periodSeconds": 10,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
    }


def _security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    {"name": "PYTHONUNBUFFERED", "value": "1"},
]


def _where(instance: TierInstance) -> list[str]:
    out = ["--region", instance.region] if instance.region else []
    return out + (["--zone", instance.zone] if instance.zone else [])


def _mounts(instance: TierInstance, with_auth: bool) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": conv.TOPOLOGY_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if with_auth:
        mounts.append({"name": "auth", "mountPath": conv.AUTH_DIR, "readOnly": True})
    if instance.identities:
        mounts.append({"name": "tls", "mountPath": conv.TLS_DIR, "readOnly": True})
    return mounts


def tier_container(
    instance: TierInstance, options: RenderOptions, *, with_auth: bool, tls: bool
) -> dict[str, Any]:
    args = [instance.kind, "--config", conv.TOPOLOGY_FILE, *_where(instance)]
    if with_auth:
        args += ["--auth-file", conv.AUTH_FILE]
    args += ["--grace", f"{options.grace_s:g}", "--log-format", options.log_format]
    ports = [{"name": "grpc", "containerPort": instance.grpc_port, "protocol": "TCP"}]
    if instance.openai_port is not None:
        ports.append({"name": "openai", "containerPort": instance.openai_port, "protocol": "TCP"})
    if instance.ext_proc_port is not None:
        ports.append(
            {"name": "ext-proc", "containerPort": instance.ext_proc_port, "protocol": "TCP"}
        )
    ports.append({"name": "ops", "containerPort": instance.ops_port, "protocol": "TCP"})
    requests, limits = _RESOURCES[instance.kind]
    container: dict[str, Any] = {
        "name": instance.kind,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        "env": list(_ENV),
        "ports": ports,
        **_probes(instance, tls),
        "resources": {"requests": dict(requests), "limits": dict(limits)},
        "securityContext": _security(),
        "volumeMounts": _mounts(instance, with_auth),
    }
    if instance.kind == "global":
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": conv.EDGE_PRESTOP_S}}}
    return container


def gpus_sidecar(instance: TierInstance, options: RenderOptions) -> dict[str, Any]:
    """The zone's emulated GPUs, on loopback in the local tier's pod."""
    ports = []
    for k, gpu in enumerate(instance.emulated):
        ports.append({"name": f"gpu{k}", "containerPort": gpu.port, "protocol": "TCP"})
        if gpu.metrics_port is not None:
            ports.append(
                {"name": f"gpu{k}-metrics", "containerPort": gpu.metrics_port, "protocol": "TCP"}
            )
    requests, limits = _RESOURCES["gpus"]
    return {
        "name": "gpus",
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "args": [
            "worker",
            "--config",
            conv.TOPOLOGY_FILE,
            *_where(instance),
            "--log-format",
            options.log_format,
        ],
        "env": list(_ENV),
        "ports": ports,
        "resources": {"requests": dict(requests), "limits": dict(limits)},
        "securityContext": _security(),
        "volumeMounts": _mounts(instance, False),
    }


def volumes(instance: TierInstance, *, with_auth: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": CONFIG_MAP}},
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
    ]
    if with_auth:
        out.append({"name": "auth", "secret": {"secretName": AUTH_SECRET, "defaultMode": 0o440}})
    if instance.identities:
        out.append(
            {"name": "tls", "projected": {"defaultMode": 0o440, "sources": _tls_sources(instance)}}
        )
    return out


def _tls_sources(instance: TierInstance) -> list[dict[str, Any]]:
    """Each identity's Secret (cert-manager's layout: tls.crt, tls.key, ca.crt) as the
    files the topology's ``tls`` names: ``ca.pem``, ``certs/<identity path>/cert.pem``."""
    sources = []
    for n, identity in enumerate(instance.identities):
        folder = "/".join(("certs", *identity.path))
        items = [
            {"key": "tls.crt", "path": f"{folder}/cert.pem"},
            {"key": "tls.key", "path": f"{folder}/key.pem"},
        ]
        if n == 0:
            items.append({"key": "ca.crt", "path": "ca.pem"})
        sources.append({"secret": {"name": tls_secret(identity), "items": items}})
    return sources


def placement(instance: TierInstance, selector: dict[str, str]) -> dict[str, Any]:
    """Zone pinning (local: its zone; regional: its region's zones) and spreading."""
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(selector)},
        }
        for key in ((HOST_KEY,) if instance.kind == "local" else (ZONE_KEY, HOST_KEY))
    ]
    out: dict[str, Any] = {"topologySpreadConstraints": spread}
    if instance.zones:
        term = {
            "matchExpressions": [
                {"key": ZONE_KEY, "operator": "In", "values": list(instance.zones)}
            ]
        }
        out["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    return out


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": conv.RUN_AS,
        "runAsGroup": conv.RUN_AS,
        "fsGroup": conv.RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
