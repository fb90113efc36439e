"""Where a tier is dialled, apart from where it binds: the ``address`` of a tier's
entry and the topology's ``dns`` key.

A tier binds ``listen``; its parent (for the global tier: its clients) dials
``address``, a DNS name or an IP address and a port, which defaults to ``listen``.
A name may stand for several replicas of the tier (a Kubernetes Service); parents
resolve it with gRPC's DNS resolver and spread calls over every address it
resolves to (``common.request.replicas``). ``dns`` names the name server that
resolver asks: absent, the system's (``dns:///``); ``dns://HOST:PORT/``, that one
(tests run their own on loopback).
"""

from __future__ import annotations

import ipaddress
import re

from common.config.node import ConfigError, ConfigNode, Endpoint, parse_endpoint

# gRPC's DNS resolver with the system's name servers.
DEFAULT_DNS = "dns:///"

# A DNS name: RFC 1123 labels, a trailing dot allowed.
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DNS_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
_RESOLVER = re.compile(r"dns://([^/]+)/")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_address(node: ConfigNode, listen: Endpoint) -> Endpoint:
    """``address`` of a tier's entry: where its parent dials it; absent: ``listen``."""
    if "address" not in node.raw:
        node.seen.add("address")
        return listen
    path = node.key_path("address")
    address = parse_endpoint(node.get("address", kind=str), path)
    if address.port == 0:
        raise ConfigError(f"{path}: a parent cannot dial port 0; give the port the tier serves")
    if not (_is_ip(address.host) or _DNS_NAME.fullmatch(address.host)):
        raise ConfigError(f"{path}: {address.host!r} is neither an IP address nor a DNS name")
    return address


def parse_dns(root: ConfigNode) -> str:
    """``dns`` of a topology: ``dns://HOST:PORT/`` (a name server), or ``dns:///``."""
    text = root.get("dns", DEFAULT_DNS, kind=str)
    if text == DEFAULT_DNS:
        return text
    match = _RESOLVER.fullmatch(text)
    if match is None:
        raise ConfigError(f"dns: expected 'dns://HOST:PORT/' (a name server), got {text!r}")
    server = parse_endpoint(match.group(1), "dns")
    if server.port == 0 or not _is_ip(server.host):
        raise ConfigError(f"dns: expected a name server's IP and port 1..65535, got {text!r}")
    return text
