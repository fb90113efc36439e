"""The mechanics of reading configuration: a node that knows its key path,
endpoints, and the error every bad value raises.

Every key is checked: an unknown key, a missing key or a bad value raises
``ConfigError`` naming the key's path (``regions[1].zones[0].gpus[2].hardware``),
so a typo never turns into a silent default.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names its key path."""


@dataclass(frozen=True)
class Endpoint:
    """A loopback or cluster address ``host:port``; port 0 means 'pick one at launch'.

    ``reuse_port``: the server binding it sets SO_REUSEPORT, sharing the port with
    the other workers of its tier process (``meridian ... --workers N``, cli.workers);
    never read from a topology file, and not part of the address (equality ignores it).
    Off, a second server on a taken port fails to start, as a router must.
    """

    host: str
    port: int
    reuse_port: bool = field(default=False, compare=False)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return self.address


class ConfigNode:
    """A mapping being read, which remembers its path and the keys it consumed."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path or '<root>'}: expected a mapping, got {type(raw).__name__}")
        self.raw = raw
        self.path = path
        self.seen: set[str] = set()

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default: Any = ..., kind: type | tuple[type, ...] = object) -> Any:
        self.seen.add(key)
        if key not in self.raw:
            if default is ...:
                raise ConfigError(f"{self.key_path(key)}: required key is missing")
            return default
        value = self.raw[key]
        if kind is not object and isinstance(value, float) and value != value:
            # YAML's .nan: every comparison with it is False, so no range check refuses it.
            name = getattr(kind, "__name__", kind)
            raise ConfigError(f"{self.key_path(key)}: expected {name}, got nan (not a number)")
        numeric = kind is float or (isinstance(kind, tuple) and float in kind)
        if numeric and isinstance(value, int) and abs(value) > sys.float_info.max:
            raise ConfigError(
                f"{self.key_path(key)}: a number of {len(str(abs(value)))} digits is too large"
            )
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            raise ConfigError(
                f"{self.key_path(key)}: expected {getattr(kind, '__name__', kind)}, got {value!r}"
            )
        return value

    def child(self, key: str) -> ConfigNode:
        self.seen.add(key)
        if key not in self.raw:
            raise ConfigError(f"{self.key_path(key)}: required key is missing")
        return ConfigNode(self.raw[key], self.key_path(key))

    def items(self, key: str) -> list[ConfigNode]:
        value = self.get(key, kind=list)
        if not value:
            raise ConfigError(f"{self.key_path(key)}: must list at least one entry")
        return [ConfigNode(item, f"{self.key_path(key)}[{i}]") for i, item in enumerate(value)]

    def get_items(self, key: str) -> list[ConfigNode]:
        """Like ``items`` but the list may be empty or absent."""
        value = self.get(key, [], kind=list)
        return [ConfigNode(item, f"{self.key_path(key)}[{i}]") for i, item in enumerate(value)]

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self.seen, key=str)  # YAML keys: any types
        if unknown:
            raise ConfigError(f"{self.key_path(unknown[0])}: unknown key")


def parse_endpoint(text: Any, path: str) -> Endpoint:
    """Parse ``host:port`` (``[::1]:port`` for IPv6)."""
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"{path}: expected 'host:port', got {text!r}")
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{path}: port must be an integer, got {port_text!r}") from None
    if not host or not 0 <= port <= 65535:
        raise ConfigError(f"{path}: expected 'host:port' with port 0..65535, got {text!r}")
    return Endpoint(host, port)


def require_positive(node: ConfigNode, key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{node.key_path(key)}: must be > 0, got {value}")


def require_unique(names: list[str], path: str) -> None:
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{path}: duplicate names {sorted(dup)}")
