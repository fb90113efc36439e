"""Topology configuration: one YAML file describes a whole deployment.

The file is read once at start into frozen dataclasses. Every key is checked:
an unknown key, a missing key or a bad value raises ``ConfigError`` naming the
key's path (``regions[1].zones[0].gpus[2].hardware``), so a typo never turns
into a silent default.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.geo import GeoPoint

# Relative speed of each hardware class, A100 = 1.0 (DESIGN.md: H100 ~ 2x A100,
# A100 ~ 1.7x V100).
HARDWARE_SPEED: Mapping[str, float] = {"V100": 0.6, "A100": 1.0, "H100": 2.0, "H200": 2.3}
# KV-cache capacity in tokens of a typical 7-13B model on each class's memory.
HARDWARE_KV_TOKENS: Mapping[str, int] = {
    "V100": 16_384,
    "A100": 65_536,
    "H100": 81_920,
    "H200": 131_072,
}


DEFAULT_VERSIONS = frozenset({"1"})


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names its key path."""


@dataclass(frozen=True)
class Endpoint:
    """A loopback or cluster address ``host:port``; port 0 means 'pick one at launch'."""

    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True)
class GpuConfig:
    """One GPU inference server (a V2 endpoint) behind a local tier."""

    name: str
    endpoint: Endpoint
    metrics_endpoint: Endpoint
    hardware: str
    models: tuple[str, ...]
    throttle: float = 1.0
    max_concurrency: int = 16
    kv_cache_tokens: int = 65_536
    # Versions served per model; a model listed without "@version" serves version "1".
    versions: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def serves(self, model: str, version: str = "") -> bool:
        """True when this GPU serves ``model`` (at ``version``, when one is asked for)."""
        if model not in self.models:
            return False
        return not version or version in self.versions.get(model, DEFAULT_VERSIONS)

    @property
    def speed(self) -> float:
        """Effective speed relative to an A100: hardware class times throttle."""
        return HARDWARE_SPEED[self.hardware] * self.throttle


@dataclass(frozen=True)
class ZoneConfig:
    """A zone: one local tier in front of its GPUs."""

    name: str
    location: GeoPoint
    endpoint: Endpoint
    gpus: tuple[GpuConfig, ...]
    ops: Endpoint | None = None

    @property
    def models(self) -> frozenset[str]:
        return frozenset(m for gpu in self.gpus for m in gpu.models)


@dataclass(frozen=True)
class RegionConfig:
    """A region: one regional tier in front of its zones."""

    name: str
    location: GeoPoint
    endpoint: Endpoint
    zones: tuple[ZoneConfig, ...]
    ops: Endpoint | None = None

    @property
    def models(self) -> frozenset[str]:
        return frozenset(m for zone in self.zones for m in zone.models)


@dataclass(frozen=True)
class GlobalConfig:
    """The global tier: the client-facing endpoint."""

    endpoint: Endpoint
    location: GeoPoint
    # Ops HTTP (/healthz, /readyz, /api/state, /metrics); None: not served.
    ops: Endpoint | None = None


PRIORITY_ORDER = ("critical", "standard", "sheddable")


@dataclass(frozen=True)
class TenantConfig:
    """A customer: its API keys (SHA-256 hex digests only), limits and rights."""

    id: str
    key_hashes: frozenset[str]
    priority_ceiling: str = "standard"
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_concurrent: int | None = None
    # Data residency: the regions it may be served in (empty: any).
    allowed_regions: frozenset[str] = frozenset()
    weight: float = 1.0

    def cap_priority(self, asked: str) -> str:
        """The asked priority, lowered to the tenant's ceiling."""
        if PRIORITY_ORDER.index(asked) < PRIORITY_ORDER.index(self.priority_ceiling):
            return self.priority_ceiling
        return asked


@dataclass(frozen=True)
class AuthConfig:
    """Who may call the edge. ``enabled: false`` is for a trusted private deployment."""

    enabled: bool = False
    tenants: tuple[TenantConfig, ...] = ()
    # SHA-256 digests of the keys that may call the Admin API at the global tier.
    admin_key_hashes: frozenset[str] = frozenset()

    def tenant(self, tenant_id: str) -> TenantConfig | None:
        for tenant in self.tenants:
            if tenant.id == tenant_id:
                return tenant
        return None


@dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS between tiers (and optionally towards clients).

    Every tier serves with ``cert``/``key`` and requires a client certificate
    signed by ``ca`` from the tier above; every tier calls its children with the
    same pair. ``client_facing`` makes the global endpoint TLS too (server-side
    only: clients authenticate with API keys).
    """

    ca: str
    cert: str
    key: str
    client_facing: bool = False


# gRPC keeps message and metadata limits in C ints.
GRPC_MAX_LIMIT = 2**31 - 1
# Room for gRPC's own headers and the metadata tiers add between themselves.
MIN_METADATA_BYTES = 8 * 1024


@dataclass(frozen=True)
class Limits:
    """How big a request may be; every tier enforces them before doing any work.

    ``max_message_bytes`` and ``max_metadata_bytes`` are gRPC server options
    (``common.grpc_server.server_options``): gRPC itself refuses a larger
    message or header block with RESOURCE_EXHAUSTED before any Meridian code
    runs. ``max_prompt_bytes`` (UTF-8 bytes of ``text_input``) and
    ``max_inputs`` are checked by ``common.v2.parse_generate``
    (INVALID_ARGUMENT).
    """

    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int = 256 * 1024
    max_inputs: int = 16
    max_metadata_bytes: int = 16 * 1024


DEFAULT_TENANT_HEADROOM = 0.7


@dataclass(frozen=True)
class Topology:
    """A whole deployment, as read from one YAML file."""

    global_tier: GlobalConfig
    regions: tuple[RegionConfig, ...]
    redis_url: str = "redis://127.0.0.1:6379/0"
    summary_cadence_s: float = 0.5
    # Readers use only the newest entry; 120 keeps a minute of history at 500 ms.
    summary_stream_maxlen: int = 120
    health_interval_s: float = 0.5
    time_scale: float = 1.0
    slow_start_window_s: float = 30.0
    # Regions and zones that come back ramp their share up over this window.
    failback_window_s: float = 10.0
    # Fraction of a zone's slots a heavy tenant may not take while a light tenant
    # is active (local_lb.tenancy); 0 is purely work-conserving.
    tenant_headroom: float = DEFAULT_TENANT_HEADROOM
    # Measured RTT, client region -> serving region -> ms; overrides distance estimates.
    rtt_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig | None = None
    limits: Limits = field(default_factory=Limits)

    @property
    def models(self) -> frozenset[str]:
        return frozenset(m for region in self.regions for m in region.models)

    @property
    def summary_ttl_s(self) -> float:
        """A summary older than this means 'unknown' (three missed cadences)."""
        return 3 * self.summary_cadence_s

    def region(self, name: str) -> RegionConfig:
        for region in self.regions:
            if region.name == name:
                return region
        raise ConfigError(f"no region named {name!r}; known: {[r.name for r in self.regions]}")

    def zone(self, region: str, zone: str) -> ZoneConfig:
        for z in self.region(region).zones:
            if z.name == zone:
                return z
        names = [z.name for z in self.region(region).zones]
        raise ConfigError(f"no zone {zone!r} in region {region!r}; known: {names}")

    def endpoints(self) -> Iterator[Endpoint]:
        """Every endpoint the topology names (for port resolution and checks)."""
        yield self.global_tier.endpoint
        for region in self.regions:
            yield region.endpoint
            for zone in region.zones:
                yield zone.endpoint
                for gpu in zone.gpus:
                    yield gpu.endpoint
                    yield gpu.metrics_endpoint


# --------------------------------------------------------------------------- parsing


class _Node:
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
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            raise ConfigError(
                f"{self.key_path(key)}: expected {getattr(kind, '__name__', kind)}, got {value!r}"
            )
        return value

    def child(self, key: str) -> _Node:
        self.seen.add(key)
        if key not in self.raw:
            raise ConfigError(f"{self.key_path(key)}: required key is missing")
        return _Node(self.raw[key], self.key_path(key))

    def items(self, key: str) -> list[_Node]:
        value = self.get(key, kind=list)
        if not value:
            raise ConfigError(f"{self.key_path(key)}: must list at least one entry")
        return [_Node(item, f"{self.key_path(key)}[{i}]") for i, item in enumerate(value)]

    def get_items(self, key: str) -> list[_Node]:
        """Like ``items`` but the list may be empty or absent."""
        value = self.get(key, [], kind=list)
        return [_Node(item, f"{self.key_path(key)}[{i}]") for i, item in enumerate(value)]

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self.seen)
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


def _location(node: _Node, key: str, default: GeoPoint | None = None) -> GeoPoint:
    if key not in node.raw and default is not None:
        node.seen.add(key)
        return default
    loc = node.child(key)
    point = GeoPoint(loc.get("lat", kind=float), loc.get("lon", kind=float))
    loc.done()
    if not (-90 <= point.lat <= 90 and -180 <= point.lon <= 180):
        raise ConfigError(f"{loc.path}: lat must be in [-90, 90] and lon in [-180, 180]")
    return point


def _positive(node: _Node, key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{node.key_path(key)}: must be > 0, got {value}")


def _gpu(node: _Node) -> GpuConfig:
    hardware = node.get("hardware", kind=str)
    if hardware not in HARDWARE_SPEED:
        raise ConfigError(
            f"{node.key_path('hardware')}: unknown hardware class {hardware!r}; "
            f"known: {sorted(HARDWARE_SPEED)}"
        )
    entries = node.get("models", kind=list)
    if not entries or not all(isinstance(m, str) and m and not m.startswith("@") for m in entries):
        raise ConfigError(
            f"{node.key_path('models')}: expected a non-empty list of model names "
            "('name' or 'name@version')"
        )
    versions: dict[str, set[str]] = {}
    for entry in entries:
        name, _, version = entry.partition("@")
        versions.setdefault(name, set()).add(version or "1")
    models = list(versions)
    throttle = node.get("throttle", 1.0, kind=float)
    if not 0 < throttle <= 1:
        raise ConfigError(f"{node.key_path('throttle')}: must be in (0, 1], got {throttle}")
    max_concurrency = node.get("max_concurrency", 16, kind=int)
    _positive(node, "max_concurrency", max_concurrency)
    kv_tokens = node.get("kv_cache_tokens", HARDWARE_KV_TOKENS[hardware], kind=int)
    _positive(node, "kv_cache_tokens", kv_tokens)
    gpu = GpuConfig(
        name=node.get("name", kind=str),
        endpoint=parse_endpoint(node.get("listen"), node.key_path("listen")),
        metrics_endpoint=parse_endpoint(
            node.get("metrics_listen", "127.0.0.1:0"), node.key_path("metrics_listen")
        ),
        hardware=hardware,
        models=tuple(models),
        throttle=throttle,
        max_concurrency=max_concurrency,
        kv_cache_tokens=kv_tokens,
        versions={m: frozenset(v) for m, v in versions.items()},
    )
    node.done()
    return gpu


def _names(zone: ZoneConfig) -> tuple[str, ...]:
    return (zone.name, *(g.name for g in zone.gpus))


def _unique(names: list[str], path: str) -> None:
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{path}: duplicate names {sorted(dup)}")


def _digests(node: _Node, key: str, default: Any = ...) -> list[str]:
    keys: list[Any] = node.get(key, default, kind=list)
    for i, digest in enumerate(keys):
        if not (isinstance(digest, str) and len(digest) == 64 and _is_hex(digest)):
            raise ConfigError(
                f"{node.key_path(key)}[{i}]: expected a SHA-256 hex digest "
                "(64 hex characters; `meridian keygen` prints one)"
            )
    return keys


def _tenant(node: _Node, regions: set[str]) -> TenantConfig:
    keys = _digests(node, "api_key_sha256")
    ceiling = node.get("priority_ceiling", "standard", kind=str)
    if ceiling not in PRIORITY_ORDER:
        raise ConfigError(
            f"{node.key_path('priority_ceiling')}: must be one of {', '.join(PRIORITY_ORDER)}"
        )
    allowed = node.get("allowed_regions", [], kind=list)
    for name in allowed:
        if name not in regions:
            raise ConfigError(f"{node.key_path('allowed_regions')}: unknown region {name!r}")
    limits: dict[str, float | None] = {}
    for key in ("requests_per_s", "tokens_per_min"):
        value = node.get(key, None, kind=(int, float, type(None)))
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise ConfigError(f"{node.key_path(key)}: must be > 0, got {value!r}")
        limits[key] = None if value is None else float(value)
    concurrent = node.get("max_concurrent", None, kind=(int, type(None)))
    if concurrent is not None and (isinstance(concurrent, bool) or concurrent <= 0):
        raise ConfigError(f"{node.key_path('max_concurrent')}: must be > 0, got {concurrent!r}")
    weight = node.get("weight", 1.0, kind=float)
    _positive(node, "weight", weight)
    tenant = TenantConfig(
        id=node.get("id", kind=str),
        key_hashes=frozenset(d.lower() for d in keys),
        priority_ceiling=ceiling,
        requests_per_s=limits["requests_per_s"],
        tokens_per_min=limits["tokens_per_min"],
        max_concurrent=concurrent,
        allowed_regions=frozenset(allowed),
        weight=weight,
    )
    node.done()
    return tenant


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def _auth(root: _Node, regions: set[str]) -> AuthConfig:
    if "auth" not in root.raw:
        root.seen.add("auth")
        return AuthConfig()
    node = root.child("auth")
    enabled = node.get("enabled", kind=bool)
    tenants = tuple(_tenant(t, regions) for t in node.get_items("tenants"))
    admin_keys = frozenset(d.lower() for d in _digests(node, "admin_keys", []))
    node.done()
    _unique([t.id for t in tenants], "auth.tenants")
    seen: set[str] = set()
    for tenant in tenants:
        if seen & tenant.key_hashes:
            raise ConfigError(f"auth.tenants: an API key is shared by two tenants ({tenant.id})")
        seen |= tenant.key_hashes
    if seen & admin_keys:
        raise ConfigError("auth.admin_keys: an admin key is also a tenant's API key")
    if enabled and not tenants:
        raise ConfigError("auth.tenants: authentication is enabled but no tenant is configured")
    return AuthConfig(enabled=enabled, tenants=tenants, admin_key_hashes=admin_keys)


def _tls(root: _Node) -> TlsConfig | None:
    if "tls" not in root.raw:
        root.seen.add("tls")
        return None
    node = root.child("tls")
    tls = TlsConfig(
        ca=node.get("ca", kind=str),
        cert=node.get("cert", kind=str),
        key=node.get("key", kind=str),
        client_facing=node.get("client_facing", False, kind=bool),
    )
    node.done()
    for key in ("ca", "cert", "key"):
        if not Path(getattr(tls, key)).is_file():
            raise ConfigError(f"tls.{key}: no such file {getattr(tls, key)!r}")
    return tls


def _limits(root: _Node) -> Limits:
    if "limits" not in root.raw:
        root.seen.add("limits")
        return Limits()
    node = root.child("limits")
    default = Limits()
    values: dict[str, int] = {}
    for key, floor in (
        ("max_message_bytes", 1),
        ("max_prompt_bytes", 1),
        ("max_inputs", 1),
        ("max_metadata_bytes", MIN_METADATA_BYTES),
    ):
        value = node.get(key, getattr(default, key), kind=int)
        if not floor <= value <= GRPC_MAX_LIMIT:
            raise ConfigError(
                f"{node.key_path(key)}: must be between {floor} and {GRPC_MAX_LIMIT}, got {value}"
            )
        values[key] = value
    node.done()
    limits = Limits(**values)
    if limits.max_prompt_bytes >= limits.max_message_bytes:
        raise ConfigError(
            f"limits.max_prompt_bytes: {limits.max_prompt_bytes} can never be reached: "
            f"a whole request may be only {limits.max_message_bytes} bytes "
            "(limits.max_message_bytes)"
        )
    return limits


def _rtt_matrix(root: _Node, regions: set[str]) -> dict[str, dict[str, float]]:
    raw = root.get("rtt_ms", {}, kind=dict)
    matrix: dict[str, dict[str, float]] = {}
    for src, row in raw.items():
        path = f"rtt_ms.{src}"
        if src not in regions or not isinstance(row, dict):
            raise ConfigError(f"{path}: expected a known region mapping to {{region: ms}}")
        matrix[src] = {}
        for dst, ms in row.items():
            if dst not in regions:
                raise ConfigError(f"{path}.{dst}: unknown region")
            if isinstance(ms, bool) or not isinstance(ms, int | float) or ms < 0:
                raise ConfigError(f"{path}.{dst}: expected milliseconds >= 0, got {ms!r}")
            matrix[src][dst] = float(ms)
    return matrix


def _ops(node: _Node) -> Endpoint | None:
    """The optional ``ops_listen`` address of a tier (absent: no ops HTTP)."""
    text = node.get("ops_listen", None)
    return None if text is None else parse_endpoint(text, node.key_path("ops_listen"))


def topology_from_mapping(raw: Any) -> Topology:
    """Build and validate a ``Topology`` from parsed YAML."""
    root = _Node(raw, "")
    glob = root.child("global")
    global_tier = GlobalConfig(
        endpoint=parse_endpoint(glob.get("listen"), glob.key_path("listen")),
        location=_location(glob, "location"),
        ops=_ops(glob),
    )
    glob.done()
    regions = []
    for rnode in root.items("regions"):
        rloc = _location(rnode, "location")
        zones = []
        for znode in rnode.items("zones"):
            gpus = tuple(_gpu(g) for g in znode.items("gpus"))
            _unique([g.name for g in gpus], znode.key_path("gpus"))
            zones.append(
                ZoneConfig(
                    name=znode.get("name", kind=str),
                    location=_location(znode, "location", rloc),
                    endpoint=parse_endpoint(znode.get("listen"), znode.key_path("listen")),
                    gpus=gpus,
                    ops=_ops(znode),
                )
            )
            znode.done()
        _unique([z.name for z in zones], rnode.key_path("zones"))
        regions.append(
            RegionConfig(
                name=rnode.get("name", kind=str),
                location=rloc,
                endpoint=parse_endpoint(rnode.get("listen"), rnode.key_path("listen")),
                zones=tuple(zones),
                ops=_ops(rnode),
            )
        )
        rnode.done()
    _unique([r.name for r in regions], "regions")
    # The Admin API addresses a region, zone or GPU by name alone.
    _unique(
        [n for r in regions for n in (r.name, *(n for z in r.zones for n in _names(z)))],
        "regions: region, zone and GPU names together",
    )
    cadence = root.get("summary_cadence_s", 0.5, kind=float)
    _positive(root, "summary_cadence_s", cadence)
    maxlen = root.get("summary_stream_maxlen", 120, kind=int)
    _positive(root, "summary_stream_maxlen", maxlen)
    health = root.get("health_interval_s", 0.5, kind=float)
    _positive(root, "health_interval_s", health)
    time_scale = root.get("time_scale", 1.0, kind=float)
    _positive(root, "time_scale", time_scale)
    slow_start = root.get("slow_start_window_s", 30.0, kind=float)
    if slow_start < 0:
        raise ConfigError(f"slow_start_window_s: must be >= 0, got {slow_start}")
    failback = root.get("failback_window_s", 10.0, kind=float)
    if failback < 0:
        raise ConfigError(f"failback_window_s: must be >= 0, got {failback}")
    headroom = root.get("tenant_headroom", DEFAULT_TENANT_HEADROOM, kind=float)
    if not 0.0 <= headroom <= 0.9:
        raise ConfigError(f"tenant_headroom: must be between 0 and 0.9, got {headroom}")
    rtt = _rtt_matrix(root, {r.name for r in regions})
    auth = _auth(root, {r.name for r in regions})
    tls = _tls(root)
    limits = _limits(root)
    topology = Topology(
        global_tier=global_tier,
        regions=tuple(regions),
        redis_url=root.get("redis_url", "redis://127.0.0.1:6379/0", kind=str),
        summary_cadence_s=cadence,
        summary_stream_maxlen=maxlen,
        health_interval_s=health,
        time_scale=time_scale,
        slow_start_window_s=slow_start,
        failback_window_s=failback,
        tenant_headroom=headroom,
        rtt_ms=rtt,
        auth=auth,
        tls=tls,
        limits=limits,
    )
    root.done()
    return topology


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return topology_from_mapping(raw)
