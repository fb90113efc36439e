"""Real GPU servers, outside the rendered workloads, as Services of the cluster.

A GPU server at an IP address gets a Service without a selector and an
EndpointSlice naming that address; one at a DNS name an ``ExternalName``
Service. The local tier dials the Service's name, so the cluster's DNS (and
its network policies) know every GPU by name.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from cli.k8s import names
from cli.k8s.options import RenderOptions
from cli.k8s.plan import ExternalGpu


def _labels(gpu: ExternalGpu) -> dict[str, str]:
    return {
        names.NAME: names.APP,
        names.COMPONENT: "gpu",
        names.PART_OF: names.APP,
        names.INSTANCE: gpu.service,
    }


def gpu_manifests(gpu: ExternalGpu, options: RenderOptions) -> list[dict[str, Any]]:
    meta = {"name": gpu.service, "namespace": options.namespace, "labels": _labels(gpu)}
    ports = [{"name": n, "port": p, "protocol": "TCP"} for n, p in gpu.ports]
    if not gpu.is_ip:
        spec = {"type": "ExternalName", "externalName": gpu.host, "ports": ports}
        return [{"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}]
    family = "IPv6" if ipaddress.ip_address(gpu.host).version == 6 else "IPv4"
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"ports": ports}}
    slice_labels = {
        **_labels(gpu),
        "kubernetes.io/service-name": gpu.service,
        "endpointslice.kubernetes.io/managed-by": "meridian-deploy",
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{gpu.service}-1",
            "namespace": options.namespace,
            "labels": slice_labels,
        },
        "addressType": family,
        "endpoints": [{"addresses": [gpu.host], "conditions": {"ready": True}}],
        "ports": ports,
    }
    return [service, endpoints]
