"""Who may call the fleet and how much: tenants and their keys, the Admin API's
keys, mutual TLS between tiers (and to GPUs that serve it), and request size
limits — their configuration types and how the topology file's ``auth``,
``tls`` and ``limits`` sections (and a GPU's ``tls``) are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.basics.vocabulary import ANONYMOUS_TENANT, PRIORITY_NAMES, Priority
from common.config.identity import Identity
from common.config.node import ConfigError, ConfigNode, require_positive, require_unique


@dataclass(frozen=True)
class TenantConfig:
    """A customer: its API keys (SHA-256 hex digests only), limits and rights."""

    id: str
    key_hashes: frozenset[str]
    priority_ceiling: Priority = Priority.STANDARD
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_concurrent: int | None = None
    # Data residency: the regions it may be served in (empty: any).
    allowed_regions: frozenset[str] = frozenset()
    weight: float = 1.0

    def cap_priority(self, asked: Priority) -> Priority:
        """The asked priority, lowered to the tenant's ceiling."""
        if asked.rank < self.priority_ceiling.rank:
            return self.priority_ceiling
        return asked


# The tenant of every request when authentication is off: no keys, no limits.
ANONYMOUS = TenantConfig(id=ANONYMOUS_TENANT, key_hashes=frozenset())


@dataclass(frozen=True)
class AuthConfig:
    """Who may call the edge. ``enabled: false`` is for a trusted private deployment."""

    enabled: bool = False
    tenants: tuple[TenantConfig, ...] = ()
    # SHA-256 digests of the keys that may call the Admin API at the global tier.
    admin_key_hashes: frozenset[str] = frozenset()
    # SHA-256 digests of the keys that may read the ops HTTP's data (/api/*) when
    # enabled (common.operations.ops_access); every tier checks them.
    operator_key_hashes: frozenset[str] = frozenset()

    @property
    def tenant_ids(self) -> frozenset[str]:
        return frozenset(t.id for t in self.tenants)

    def tenant(self, tenant_id: str) -> TenantConfig | None:
        for tenant in self.tenants:
            if tenant.id == tenant_id:
                return tenant
        return None


@dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS between tiers (and optionally towards clients), one identity per
    tier instance (``common.config.identity``).

    Every tier instance has its own certificate and key, in
    ``<certs>/<identity path>/cert.pem`` and ``key.pem`` (``certs/regional/eu-west/``);
    a certificate carries its instance's identity as a URI SAN. Tiers verify each
    other against ``ca``, and an inner tier serves only its parent's identity.
    ``client_facing`` makes the global endpoint TLS too (server-side only:
    clients authenticate with API keys).
    """

    ca: str
    certs: str
    client_facing: bool = False

    def cert_file(self, identity: Identity) -> Path:
        return Path(self.certs, *identity.path, CERT_FILE)

    def key_file(self, identity: Identity) -> Path:
        return Path(self.certs, *identity.path, KEY_FILE)


CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"


@dataclass(frozen=True)
class GpuTls:
    """A GPU server that serves TLS: the local tier verifies it against ``ca``
    (None: the fleet's ``tls.ca``) and presents its own certificate, which the
    GPU server may ask for."""

    ca: str | None = None


# gRPC keeps message and metadata limits in C ints.
GRPC_MAX_LIMIT = 2**31 - 1
# Room for gRPC's own headers and the metadata tiers add between themselves.
MIN_METADATA_BYTES = 8 * 1024


@dataclass(frozen=True)
class Limits:
    """How big a request may be and what a stream may hold; every tier enforces them.

    ``max_message_bytes`` and ``max_metadata_bytes`` are gRPC server options
    (``common.request.server.server_options``): gRPC itself refuses a larger
    message or header block with RESOURCE_EXHAUSTED before any Meridian code
    runs. ``max_prompt_bytes`` (UTF-8 bytes of ``text_input``) and
    ``max_inputs`` are checked by ``common.request.v2.parse_generate``
    (INVALID_ARGUMENT).

    The stream limits bound what one ``ModelStreamInfer`` can hold
    (``common.request.streaming``): requests in flight (beyond, the stream's
    requests are not read until one finishes), how long a response may wait to
    be written to a caller that stopped reading, and how long a stream may sit
    with nothing in flight. The edge also caps open streams per tenant
    (``common.request.stream_limits``) and calls per client connection
    (``common.request.per_connection``): beyond ``max_streams_per_connection`` a
    connection's calls wait at the edge, never refused, and beyond
    ``max_queued_calls_per_connection`` waiting ones it sheds with RESOURCE_EXHAUSTED.
    By default no client meets either (as Envoy, 2^31-1 calls at once).
    """

    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int = 256 * 1024
    max_inputs: int = 16
    max_metadata_bytes: int = 16 * 1024
    max_stream_requests_in_flight: int = 8
    stream_write_timeout_s: float = 10.0
    stream_idle_timeout_s: float = 300.0
    max_streams_per_connection: int = GRPC_MAX_LIMIT
    max_queued_calls_per_connection: int = 1024
    max_open_streams_per_tenant: int = 128
    # How long the local tier holds a stream's tokens to send them up as one message
    # (``common.request.coalesce``): a little smoothness traded for CPU. 0: each goes
    # at once (tokens still go up together while a writer is busy).
    stream_coalesce_ms: float = 0.0


def _digests(node: ConfigNode, key: str, default: Any = ...) -> list[str]:
    keys: list[Any] = node.get(key, default, kind=list)
    for i, digest in enumerate(keys):
        if not (isinstance(digest, str) and len(digest) == 64 and _is_hex(digest)):
            raise ConfigError(
                f"{node.key_path(key)}[{i}]: expected a SHA-256 hex digest "
                "(64 hex characters; `meridian keygen` prints one)"
            )
    return keys


def _tenant(node: ConfigNode, regions: set[str]) -> TenantConfig:
    keys = _digests(node, "api_key_sha256")
    ceiling = Priority.parse(node.get("priority_ceiling", "standard", kind=str))
    if ceiling is None:
        raise ConfigError(
            f"{node.key_path('priority_ceiling')}: must be one of {', '.join(PRIORITY_NAMES)}"
        )
    allowed = node.get("allowed_regions", [], kind=list)
    for name in allowed:
        if not isinstance(name, str):
            raise ConfigError(
                f"{node.key_path('allowed_regions')}: expected region names, got {name!r}"
            )
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
    require_positive(node, "weight", weight)
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


def parse_auth(root: ConfigNode, regions: set[str]) -> AuthConfig:
    if "auth" not in root.raw:
        root.seen.add("auth")
        return AuthConfig()
    node = root.child("auth")
    enabled = node.get("enabled", kind=bool)
    tenants = tuple(_tenant(t, regions) for t in node.get_items("tenants"))
    admin_keys = frozenset(d.lower() for d in _digests(node, "admin_keys", []))
    operator_keys = [d.lower() for d in _digests(node, "operator_key_sha256", [])]
    node.done()
    require_unique([t.id for t in tenants], "auth.tenants")
    seen: set[str] = set()
    for tenant in tenants:
        if seen & tenant.key_hashes:
            raise ConfigError(f"auth.tenants: an API key is shared by two tenants ({tenant.id})")
        seen |= tenant.key_hashes
    if seen & admin_keys:
        raise ConfigError("auth.admin_keys: an admin key is also a tenant's API key")
    for i, digest in enumerate(operator_keys):
        if digest in seen:
            raise ConfigError(f"auth.operator_key_sha256[{i}]: is also a tenant's API key")
    if enabled and not tenants:
        raise ConfigError("auth.tenants: authentication is enabled but no tenant is configured")
    return AuthConfig(
        enabled=enabled,
        tenants=tenants,
        admin_key_hashes=admin_keys,
        operator_key_hashes=frozenset(operator_keys),
    )


def parse_tls(root: ConfigNode) -> TlsConfig | None:
    if "tls" not in root.raw:
        root.seen.add("tls")
        return None
    node = root.child("tls")
    for key in ("cert", "key"):
        if key in node.raw:
            raise ConfigError(
                f"{node.key_path(key)}: one certificate for every tier is no longer accepted "
                "(any tier could speak as any other); give tls.certs, a directory with "
                "<identity>/cert.pem and key.pem per tier instance (meridian up writes one)"
            )
    tls = TlsConfig(
        ca=node.get("ca", kind=str),
        certs=node.get("certs", kind=str),
        client_facing=node.get("client_facing", False, kind=bool),
    )
    node.done()
    if not Path(tls.ca).is_file():
        raise ConfigError(f"{node.key_path('ca')}: no such file {tls.ca!r}")
    # Each instance's own files are checked when it starts (common.config.tls): a
    # machine holds only the certificates of the instances it runs.
    if not Path(tls.certs).is_dir():
        raise ConfigError(f"{node.key_path('certs')}: no such directory {tls.certs!r}")
    return tls


def parse_gpu_tls(node: ConfigNode) -> GpuTls | None:
    """A GPU's ``tls``: absent or false (plaintext), true (the fleet's CA) or ``{ca: PATH}``."""
    raw = node.get("tls", False, kind=(bool, dict))
    if raw is False:
        return None
    if raw is True:
        return GpuTls()
    sub = node.child("tls")
    ca = sub.get("ca", kind=str)
    sub.done()
    if not Path(ca).is_file():
        raise ConfigError(f"{sub.key_path('ca')}: no such file {ca!r}")
    return GpuTls(ca=ca)


# Stream timeouts: at most a day (longer is surely a unit mistake).
MAX_STREAM_TIMEOUT_S = 86_400.0
# Holding tokens longer than this is no longer streaming.
MAX_STREAM_COALESCE_MS = 1000.0


def parse_limits(root: ConfigNode) -> Limits:
    if "limits" not in root.raw:
        root.seen.add("limits")
        return Limits()
    node = root.child("limits")
    default = Limits()
    values: dict[str, Any] = {}
    for key, floor in (
        ("max_message_bytes", 1),
        ("max_prompt_bytes", 1),
        ("max_inputs", 1),
        ("max_metadata_bytes", MIN_METADATA_BYTES),
        ("max_stream_requests_in_flight", 1),
        ("max_streams_per_connection", 1),
        ("max_queued_calls_per_connection", 1),
        ("max_open_streams_per_tenant", 1),
    ):
        value = node.get(key, getattr(default, key), kind=int)
        if not floor <= value <= GRPC_MAX_LIMIT:
            raise ConfigError(
                f"{node.key_path(key)}: must be between {floor} and {GRPC_MAX_LIMIT}, got {value}"
            )
        values[key] = value
    for key in ("stream_write_timeout_s", "stream_idle_timeout_s"):
        seconds = node.get(key, getattr(default, key), kind=float)
        # `not <=` also refuses NaN.
        if not (0 < seconds <= MAX_STREAM_TIMEOUT_S):
            raise ConfigError(
                f"{node.key_path(key)}: must be > 0 and at most {MAX_STREAM_TIMEOUT_S:g} s, "
                f"got {seconds}"
            )
        values[key] = seconds
    coalesce = node.get("stream_coalesce_ms", default.stream_coalesce_ms, kind=float)
    if not (0 <= coalesce <= MAX_STREAM_COALESCE_MS):  # `not <=` also refuses NaN
        raise ConfigError(
            f"{node.key_path('stream_coalesce_ms')}: must be between 0 and "
            f"{MAX_STREAM_COALESCE_MS:g} ms, got {coalesce}"
        )
    values["stream_coalesce_ms"] = coalesce
    node.done()
    limits = Limits(**values)
    if limits.max_prompt_bytes >= limits.max_message_bytes:
        raise ConfigError(
            f"limits.max_prompt_bytes: {limits.max_prompt_bytes} can never be reached: "
            f"a whole request may be only {limits.max_message_bytes} bytes "
            "(limits.max_message_bytes)"
        )
    return limits
