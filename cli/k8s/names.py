"""Kubernetes names and labels of a rendered fleet.

A region or zone name becomes part of a resource name (a DNS-1035 label: lower
case letters, digits and '-', at most 63 characters, starting with a letter),
so ``meridian-local-us-east-1a``. A name that cannot be mapped, or two that map
to the same, is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import ipaddress
import re

from common.config.node import ConfigError

PREFIX = "meridian"
APP = "meridian"
PART_OF = "app.kubernetes.io/part-of"
NAME = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"
INSTANCE = "app.kubernetes.io/instance"
REGION_LABEL = "meridian.dev/region"
ZONE_LABEL = "meridian.dev/zone"
ZONE_KEY = "topology.kubernetes.io/zone"
HOST_KEY = "kubernetes.io/hostname"

_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def resource_name(*parts: str, key: str) -> str:
    """``meridian-<parts>`` as a DNS-1035 label; ``key`` names the topology key on error."""
    name = "-".join((PREFIX, *(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts)))
    if len(name) > 63 or not _LABEL.match(name):
        raise ConfigError(
            f"{key}: {'-'.join(parts)!r} makes the Kubernetes name {name!r}, which is not "
            "a DNS label of at most 63 characters (letters, digits, '-')"
        )
    return name


def check_namespace(namespace: str) -> str:
    if len(namespace) > 63 or not _NAMESPACE.match(namespace):
        raise ConfigError(
            f"--namespace: {namespace!r} is not a DNS label "
            "(lower case letters, digits, '-', at most 63 characters)"
        )
    return namespace


def label_value(value: str, key: str) -> str:
    """A region or zone name as a label value (node affinity matches it verbatim)."""
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ConfigError(f"{key}: {value!r} cannot be a Kubernetes label value")
    return value


def fqdn(service: str, namespace: str) -> str:
    """The cluster DNS name a parent dials."""
    return f"{service}.{namespace}.svc.cluster.local"


def unique(names: dict[str, str], what: str) -> None:
    """``names``: resource name -> the topology key it came from; two keys, one name: error."""
    seen: dict[str, str] = {}
    for key, name in names.items():
        if name in seen:
            raise ConfigError(
                f"{key}: makes the Kubernetes {what} name {name!r}, as {seen[name]} does"
            )
        seen[name] = key


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() in LOOPBACK_NAMES
