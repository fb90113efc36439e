"""Topology configuration: one YAML file describes a whole deployment.

The file is read once at start into frozen dataclasses. Every key is checked:
an unknown key, a missing key or a bad value raises ``ConfigError`` naming the
key's path (``common.config.node``). Tenants, TLS and size limits are read by
``common.config.access``, a GPU's entry by ``common.config.gpu``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from common.basics.geo import GeoPoint
from common.basics.redis_url import check_redis_url
from common.config.access import (
    AuthConfig,
    Limits,
    TlsConfig,
    parse_auth,
    parse_limits,
    parse_tls,
)
from common.config.addresses import DEFAULT_DNS, parse_address, parse_dns
from common.config.ext_proc import ExtProcConfig, parse_ext_proc
from common.config.gpu import GpuConfig, parse_gpu
from common.config.identity import check_fleet_names
from common.config.liveness import Liveness, parse_liveness
from common.config.node import (
    ConfigError,
    ConfigNode,
    Endpoint,
    parse_endpoint,
    require_positive,
    require_unique,
)
from common.config.openai_edge import OpenAIEdgeConfig, parse_openai_edge


@dataclass(frozen=True)
class ZoneConfig:
    """A zone: one local tier in front of its GPUs."""

    name: str
    location: GeoPoint
    # What the local tier binds (``listen``) and what the regional tier dials (``address``,
    # default: ``listen``; a name may stand for several replicas: common.config.addresses).
    endpoint: Endpoint
    address: Endpoint
    gpus: tuple[GpuConfig, ...]
    ops: Endpoint | None = None
    # The endpoint-picker mode for Envoy (common.config.ext_proc); None: off.
    ext_proc: ExtProcConfig | None = None
    # OpenAI-compatible HTTP served by this zone's local tier to clients directly
    # (``openai_listen``, ``openai_timeout_s``, as in ``global``); None: not served.
    openai: OpenAIEdgeConfig | None = None

    @property
    def models(self) -> frozenset[str]:
        return frozenset(m for gpu in self.gpus for m in gpu.models)


@dataclass(frozen=True)
class RegionConfig:
    """A region: one regional tier in front of its zones."""

    name: str
    location: GeoPoint
    # What the regional tier binds (``listen``) and the global tier dials (``address``).
    endpoint: Endpoint
    address: Endpoint
    zones: tuple[ZoneConfig, ...]
    ops: Endpoint | None = None
    # The region's own Redis (its zone streams); None: the topology's redis_url
    # (which Redis holds what: common.config.redis_layout).
    redis_url: str | None = None
    # OpenAI-compatible HTTP served by this region's regional tier to clients directly
    # (``openai_listen``, ``openai_timeout_s``, as in ``global``); None: not served.
    openai: OpenAIEdgeConfig | None = None

    @property
    def models(self) -> frozenset[str]:
        return frozenset(m for zone in self.zones for m in zone.models)


@dataclass(frozen=True)
class GlobalConfig:
    """The global tier: the client-facing endpoint."""

    # What the global tier binds (``listen``) and its clients dial (``address``).
    endpoint: Endpoint
    location: GeoPoint
    address: Endpoint
    # Ops HTTP (/healthz, /readyz, /api/state, /metrics); None: not served.
    ops: Endpoint | None = None
    # OpenAI-compatible HTTP (``openai_listen``, ``openai_timeout_s``); None: not served.
    openai: OpenAIEdgeConfig | None = None
    # Global replicas sharing the tenant quotas: while Redis is down each limits in
    # process at 1/replicas of every limit (× its own --workers), so together they stay
    # near it. An autoscaled edge: its most replicas.
    replicas: int = 1


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
    # A usage batch counts as written once this many Redis replicas have it (WAIT).
    usage_replicas_ack: int = 0
    # Keepalive, per-try timeout, panic threshold, slow probes (common.config.liveness).
    liveness: Liveness = field(default_factory=Liveness)
    # The DNS resolver tiers resolve their children's addresses with
    # (``dns: dns://HOST:PORT/``); "dns:///": the system's (common.request.replicas).
    dns: str = DEFAULT_DNS

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
        if self.global_tier.openai is not None:
            yield self.global_tier.openai.endpoint
        for region in self.regions:
            yield region.endpoint
            if region.openai is not None:
                yield region.openai.endpoint
            for zone in region.zones:
                yield zone.endpoint
                if zone.openai is not None:
                    yield zone.openai.endpoint
                for gpu in zone.gpus:
                    yield gpu.endpoint
                    yield gpu.metrics_endpoint


# --------------------------------------------------------------------------- parsing


def _location(node: ConfigNode, key: str, default: GeoPoint | None = None) -> GeoPoint:
    if key not in node.raw and default is not None:
        node.seen.add(key)
        return default
    loc = node.child(key)
    point = GeoPoint(loc.get("lat", kind=float), loc.get("lon", kind=float))
    loc.done()
    if not (-90 <= point.lat <= 90 and -180 <= point.lon <= 180):
        raise ConfigError(f"{loc.path}: lat must be in [-90, 90] and lon in [-180, 180]")
    return point


def _names(zone: ZoneConfig) -> tuple[str, ...]:
    return (zone.name, *(g.name for g in zone.gpus))


def _rtt_matrix(root: ConfigNode, regions: set[str]) -> dict[str, dict[str, float]]:
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
            # `not 0 <= ms <= max` also refuses NaN, infinity and ints no float can hold.
            big = sys.float_info.max
            if isinstance(ms, bool) or not isinstance(ms, int | float) or not 0 <= ms <= big:
                raise ConfigError(f"{path}.{dst}: expected milliseconds >= 0, got {ms!r}")
            matrix[src][dst] = float(ms)
    return matrix


def _ops(node: ConfigNode) -> Endpoint | None:
    """The optional ``ops_listen`` address of a tier (absent: no ops HTTP)."""
    text = node.get("ops_listen", None)
    return None if text is None else parse_endpoint(text, node.key_path("ops_listen"))


def _redis_url(node: ConfigNode, default: str | None) -> Any:
    """``redis_url``, checked now: a URL Meridian cannot dial fails the start, not a call."""
    url = node.get("redis_url", default, kind=str)
    if url is not None:
        try:
            check_redis_url(url)
        except ValueError as exc:
            raise ConfigError(f"{node.key_path('redis_url')}: {exc}") from None
    return url


def topology_from_mapping(raw: Any) -> Topology:
    """Build and validate a ``Topology`` from parsed YAML."""
    root = ConfigNode(raw, "")
    global_tier = _global(root.child("global"))
    regions = [_region(rnode) for rnode in root.items("regions")]
    require_unique([r.name for r in regions], "regions")
    # The Admin API addresses a region, zone or GPU by name alone.
    require_unique(
        [n for r in regions for n in (r.name, *(n for z in r.zones for n in _names(z)))],
        "regions: region, zone and GPU names together",
    )
    settings = _fleet_settings(root)
    region_names = {r.name for r in regions}
    rtt = _rtt_matrix(root, region_names)
    auth = parse_auth(root, region_names)
    tls = parse_tls(root)
    limits = parse_limits(root)
    topology = Topology(
        global_tier=global_tier,
        regions=tuple(regions),
        redis_url=_redis_url(root, "redis://127.0.0.1:6379/0"),
        rtt_ms=rtt,
        auth=auth,
        tls=tls,
        limits=limits,
        liveness=parse_liveness(root),
        dns=parse_dns(root),
        summary_cadence_s=settings.summary_cadence_s,
        summary_stream_maxlen=settings.summary_stream_maxlen,
        health_interval_s=settings.health_interval_s,
        time_scale=settings.time_scale,
        slow_start_window_s=settings.slow_start_window_s,
        failback_window_s=settings.failback_window_s,
        tenant_headroom=settings.tenant_headroom,
        usage_replicas_ack=_usage_replicas_ack(root),
    )
    root.done()
    _check_tls_names(topology)
    return topology


def _check_tls_names(topology: Topology) -> None:
    """With TLS, region and zone names are parts of identity URIs; a GPU verified
    against the fleet's CA needs the fleet to have one."""
    if topology.tls is not None:
        check_fleet_names([(r.name, [z.name for z in r.zones]) for r in topology.regions])
    for i, region in enumerate(topology.regions):
        for j, zone in enumerate(region.zones):
            for k, gpu in enumerate(zone.gpus):
                if gpu.tls is not None and gpu.tls.ca is None and topology.tls is None:
                    raise ConfigError(
                        f"regions[{i}].zones[{j}].gpus[{k}].tls: true needs the fleet's CA, "
                        "but the topology has no tls section; add one or give tls: {ca: PATH}"
                    )


def _global(glob: ConfigNode) -> GlobalConfig:
    listen = parse_endpoint(glob.get("listen"), glob.key_path("listen"))
    replicas = glob.get("replicas", 1, kind=int)
    if replicas < 1:
        raise ConfigError(f"{glob.key_path('replicas')}: must be >= 1, got {replicas}")
    global_tier = GlobalConfig(
        endpoint=listen,
        address=parse_address(glob, listen),
        location=_location(glob, "location"),
        ops=_ops(glob),
        openai=parse_openai_edge(glob),
        replicas=replicas,
    )
    glob.done()
    return global_tier


def _region(rnode: ConfigNode) -> RegionConfig:
    rloc = _location(rnode, "location")
    zones = [_zone(znode, rloc) for znode in rnode.items("zones")]
    require_unique([z.name for z in zones], rnode.key_path("zones"))
    listen = parse_endpoint(rnode.get("listen"), rnode.key_path("listen"))
    region = RegionConfig(
        name=rnode.get("name", kind=str),
        location=rloc,
        endpoint=listen,
        address=parse_address(rnode, listen),
        zones=tuple(zones),
        ops=_ops(rnode),
        redis_url=_redis_url(rnode, None),
        openai=parse_openai_edge(rnode),
    )
    rnode.done()
    return region


def _zone(znode: ConfigNode, region_location: GeoPoint) -> ZoneConfig:
    """A zone; its location defaults to its region's."""
    gpus = tuple(parse_gpu(g) for g in znode.items("gpus"))
    require_unique([g.name for g in gpus], znode.key_path("gpus"))
    listen = parse_endpoint(znode.get("listen"), znode.key_path("listen"))
    zone = ZoneConfig(
        name=znode.get("name", kind=str),
        location=_location(znode, "location", region_location),
        endpoint=listen,
        address=parse_address(znode, listen),
        gpus=gpus,
        ops=_ops(znode),
        ext_proc=parse_ext_proc(znode),
        openai=parse_openai_edge(znode),
    )
    znode.done()
    return zone


class _FleetSettings(NamedTuple):
    summary_cadence_s: float
    summary_stream_maxlen: int
    health_interval_s: float
    time_scale: float
    slow_start_window_s: float
    failback_window_s: float
    tenant_headroom: float


def _fleet_settings(root: ConfigNode) -> _FleetSettings:
    """The fleet-wide scalars (cadences, windows, headroom), validated in file order."""
    cadence = root.get("summary_cadence_s", 0.5, kind=float)
    require_positive(root, "summary_cadence_s", cadence)
    maxlen = root.get("summary_stream_maxlen", 120, kind=int)
    require_positive(root, "summary_stream_maxlen", maxlen)
    health = root.get("health_interval_s", 0.5, kind=float)
    require_positive(root, "health_interval_s", health)
    time_scale = root.get("time_scale", 1.0, kind=float)
    require_positive(root, "time_scale", time_scale)
    slow_start = root.get("slow_start_window_s", 30.0, kind=float)
    if slow_start < 0:
        raise ConfigError(f"slow_start_window_s: must be >= 0, got {slow_start}")
    failback = root.get("failback_window_s", 10.0, kind=float)
    if failback < 0:
        raise ConfigError(f"failback_window_s: must be >= 0, got {failback}")
    headroom = root.get("tenant_headroom", DEFAULT_TENANT_HEADROOM, kind=float)
    if not 0.0 <= headroom <= 0.9:
        raise ConfigError(f"tenant_headroom: must be between 0 and 0.9, got {headroom}")
    return _FleetSettings(cadence, maxlen, health, time_scale, slow_start, failback, headroom)


def _usage_replicas_ack(root: ConfigNode) -> int:
    acks = root.get("usage_replicas_ack", 0, kind=int)
    if acks < 0:
        raise ConfigError(f"usage_replicas_ack: must be >= 0, got {acks}")
    return int(acks)


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:  # a ValueError, not a ConfigError: name the file
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an int of 4300+ digits
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return topology_from_mapping(raw)
