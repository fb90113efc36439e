"""The topology the cluster's processes read: the same file, with cluster addresses.

Each tier entry binds every address on its pod (``listen: 0.0.0.0:PORT``) and is
dialled by its parent at its Service's DNS name (``address``,
``meridian-regional-eu-west.NS.svc.cluster.local:8001``). Emulated GPUs listen
on loopback inside their local tier's pod; a real GPU server is dialled through
its own Service (``gpus.ExternalGpu``), except one dialled with TLS, which keeps
its address: its certificate names that host. Redis: a loopback URL becomes the
``meridian-redis`` Service (and, per region, ``meridian-redis-REGION``), which
the operator provides (``README``: Deploying). TLS files are the pod's mounted
ones (``TLS_DIR``). ``global.replicas`` is the most edges the autoscaler may run,
so their quota shares while Redis is down add up to at most each limit.
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from cli.k8s.keys import public_auth
from cli.k8s.names import fqdn, is_loopback, resource_name
from cli.k8s.options import REDIS_PORT, TLS_DIR, RenderOptions
from cli.k8s.plan import Plan, TierInstance

# Every interface of the pod; IPv4, as asyncio's IPv6 sockets (the ops HTTP) are
# IPv6-only and the kubelet probes the pod's IPv4 address.
BIND = "0.0.0.0"


def cluster_topology(raw: dict[str, Any], plan: Plan, options: RenderOptions) -> dict[str, Any]:
    """``raw`` (directives resolved) rewritten for the cluster; ``raw`` is not changed."""
    out = copy.deepcopy(raw)
    by_key = {i.key: i for i in plan.instances}
    _tier_entry(out["global"], by_key["global"], options)
    # Its autoscaler may run this many edges: each one's quota share while Redis is down.
    out["global"]["replicas"] = options.max_replicas
    for i, region in enumerate(out["regions"]):
        _tier_entry(region, by_key[f"regions[{i}]"], options)
        for j, zone in enumerate(region["zones"]):
            instance = by_key[f"regions[{i}].zones[{j}]"]
            _tier_entry(zone, instance, options)
            for k, gpu in enumerate(zone["gpus"]):
                gpu.update(plan.gpu_addresses[(i, j, k)])
        if options.redis_per_region:
            region["redis_url"] = _region_redis(region, options)
    out["redis_url"] = _redis(str(out.get("redis_url", "redis://127.0.0.1:6379/0")), "", options)
    if isinstance(out.get("auth"), dict):
        out["auth"] = public_auth(out["auth"])
    if options.tls == "none":
        out.pop("tls", None)
    else:
        client_facing = bool((raw.get("tls") or {}).get("client_facing", False))
        out["tls"] = {"ca": f"{TLS_DIR}/ca.pem", "certs": f"{TLS_DIR}/certs"}
        if client_facing:
            out["tls"]["client_facing"] = True
    return out


def _tier_entry(entry: dict[str, Any], instance: TierInstance, options: RenderOptions) -> None:
    entry["listen"] = f"{BIND}:{instance.grpc_port}"
    if instance.kind != "global":
        address = f"{fqdn(instance.name, options.namespace)}:{instance.grpc_port}"
        _put_after(entry, "listen", "address", address)
    entry["ops_listen"] = f"{BIND}:{instance.ops_port}"
    if instance.openai_port is not None:
        entry["openai_listen"] = f"{BIND}:{instance.openai_port}"
    if instance.ext_proc_port is not None:
        entry["ext_proc"]["listen"] = f"{BIND}:{instance.ext_proc_port}"


def _put_after(entry: dict[str, Any], after: str, key: str, value: str) -> None:
    """Set ``entry[key]`` right after ``after`` (a reader finds the pair together)."""
    items = [(k, v) for k, v in entry.items() if k != key]
    entry.clear()
    for k, v in items:
        entry[k] = v
        if k == after:
            entry[key] = value


def _region_redis(region: dict[str, Any], options: RenderOptions) -> str:
    own = region.get("redis_url")
    service = resource_name("redis", str(region["name"]), key="regions[].name")
    return _redis(str(own) if own else f"redis://127.0.0.1:{REDIS_PORT}/0", service, options)


def _redis(url: str, service: str, options: RenderOptions) -> str:
    """A loopback Redis URL pointed at ``service`` (default ``meridian-redis``); others kept."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not is_loopback(parts.hostname or ""):
        return url
    host = fqdn(service or resource_name("redis", key="redis_url"), options.namespace)
    auth = parts.netloc.rpartition("@")[0]
    netloc = (
        f"{auth}@{host}:{parts.port or REDIS_PORT}"
        if auth
        else f"{host}:{parts.port or REDIS_PORT}"
    )
    return urlunsplit((parts.scheme, netloc, parts.path or "/0", parts.query, parts.fragment))
