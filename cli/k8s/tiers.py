"""Per tier instance: a Deployment, a Service, a PodDisruptionBudget and (global,
regional) a HorizontalPodAutoscaler.

Rolling updates add a pod before removing one (``maxSurge: 1``,
``maxUnavailable: 0``): the old pod is sent SIGTERM only once its successor is
ready. Replicas: the global and regional tiers run ``--global-replicas`` /
``--regional-replicas`` or more, set by their HPA on CPU; their Deployments
leave ``replicas`` out, as Kubernetes advises when an HPA owns the count (an
``apply`` would otherwise reset it). A local tier runs one replica per zone: its
GPU slots, central queue and session affinity are counted in one process, and a
second replica would hand out every GPU's slots a second time. Services of
inner tiers are headless, so a parent's DNS name resolves to every ready pod
and its channel spreads calls over them; the global tier's is a ClusterIP (or
``--global-service-type``) for clients.
"""

from __future__ import annotations

from typing import Any

from cli.k8s import names
from cli.k8s.options import EDGE_PRESTOP_S, RenderOptions
from cli.k8s.plan import TierInstance
from cli.k8s.pods import gpus_sidecar, placement, pod_security, tier_container, volumes

TARGET_CPU_PERCENT = 70


def labels(instance: TierInstance) -> dict[str, str]:
    out = {
        names.NAME: names.APP,
        names.INSTANCE: instance.name,
        names.COMPONENT: instance.kind,
        names.PART_OF: names.APP,
    }
    if instance.region:
        out[names.REGION_LABEL] = instance.region
    if instance.zone:
        out[names.ZONE_LABEL] = instance.zone
    return out


def selector(instance: TierInstance) -> dict[str, str]:
    return {names.NAME: names.APP, names.INSTANCE: instance.name}


def _meta(instance: TierInstance, options: RenderOptions, name: str = "") -> dict[str, Any]:
    return {
        "name": name or instance.name,
        "namespace": options.namespace,
        "labels": labels(instance),
    }


def deployment(
    instance: TierInstance,
    options: RenderOptions,
    *,
    with_auth: bool,
    tls: bool,
    config_digest: str,
) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": options.termination_grace_s
        + (EDGE_PRESTOP_S if instance.kind == "global" else 0),
        **placement(instance, selector(instance)),
    }
    if instance.emulated:
        pod["initContainers"] = [gpus_sidecar(instance, options)]
    pod["containers"] = [tier_container(instance, options, with_auth=with_auth, tls=tls)]
    pod["volumes"] = volumes(instance, with_auth=with_auth)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(instance.ops_port),
        "prometheus.io/path": "/metrics",
        # A changed topology changes the pod template, so the pods roll onto it.
        "meridian.dev/topology-sha256": config_digest,
    }
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(instance)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "revisionHistoryLimit": 5,
        "template": {
            "metadata": {"labels": labels(instance), "annotations": annotations},
            "spec": pod,
        },
    }
    if instance.kind == "local":
        spec = {"replicas": 1, **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(instance, options),
        "spec": spec,
    }


def _port(name: str, port: int, protocol: str) -> dict[str, Any]:
    return {
        "name": name,
        "port": port,
        "targetPort": name,
        "protocol": "TCP",
        "appProtocol": protocol,
    }


H2C = "kubernetes.io/h2c"


def services(instance: TierInstance, options: RenderOptions) -> list[dict[str, Any]]:
    """The instance's Service; the global tier's carries only what clients call (its ops
    HTTP, with the dashboard and /api/state, is a ClusterIP Service of its own, so a
    LoadBalancer never publishes it)."""
    ports = [_port("grpc", instance.grpc_port, H2C)]
    if instance.openai_port is not None:
        ports.append(_port("openai", instance.openai_port, "http"))
    if instance.ext_proc_port is not None:
        ports.append(_port("ext-proc", instance.ext_proc_port, H2C))
    ops = _port("ops", instance.ops_port, "http")
    if instance.kind != "global":
        spec = {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector(instance),
            "ports": [*ports, ops],
        }
        return [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(instance, options),
                "spec": spec,
            }
        ]
    edge = {"type": options.global_service_type, "selector": selector(instance), "ports": ports}
    inside = {"type": "ClusterIP", "selector": selector(instance), "ports": [ops]}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(instance, options), "spec": edge},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(instance, options, f"{instance.name}-ops"),
            "spec": inside,
        },
    ]


def disruption_budget(instance: TierInstance, options: RenderOptions) -> dict[str, Any]:
    """At most one pod of the instance evicted at a time (a drain never takes them all;
    a local tier's single pod may go: the regional tier fails its zone over)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(instance, options),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(instance)}},
    }


def autoscaler(instance: TierInstance, options: RenderOptions) -> dict[str, Any] | None:
    """CPU-driven replicas for the global and regional tiers (None for a local tier)."""
    if instance.kind == "local":
        return None
    least = options.global_replicas if instance.kind == "global" else options.regional_replicas
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(instance, options),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": instance.name,
            },
            "minReplicas": least,
            "maxReplicas": options.max_replicas,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": TARGET_CPU_PERCENT},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def tier_manifests(
    instance: TierInstance,
    options: RenderOptions,
    *,
    with_auth: bool,
    tls: bool,
    config_digest: str,
) -> list[dict[str, Any]]:
    out = [
        deployment(instance, options, with_auth=with_auth, tls=tls, config_digest=config_digest),
        *services(instance, options),
        disruption_budget(instance, options),
    ]
    hpa = autoscaler(instance, options)
    return out + ([hpa] if hpa is not None else [])
