"""Trust between tiers: mutual TLS with one identity per tier instance, and TLS to GPUs.

Routing metadata between tiers (tenant, origin, prefix hashes, attempt) is
believed only from the caller's parent, which proves who it is in the TLS
handshake. So:

- every tier instance has its own certificate, signed by the fleet's CA
  (``tls.ca``), naming its identity as a URI SAN (``common.config.identity``:
  ``spiffe://meridian/regional/eu-west``) beside the hosts it is reached at;
- the regional and local tiers serve with mutual TLS: a caller without a
  client certificate signed by ``tls.ca`` fails the handshake (UNAVAILABLE);
  one with a valid certificate of another identity than the tier's parent is
  refused with PERMISSION_DENIED (``common.request.peers``);
- the global tier serves plaintext, or server-side TLS when
  ``tls.client_facing`` (clients authenticate with API keys, not certificates);
- global → regional and regional → local channels present the caller's own
  certificate; local → GPU channels are plaintext unless the GPU's topology
  entry says ``tls`` (then verified against the fleet's CA or the GPU's own
  ``ca``, presenting the local tier's certificate, which a GPU server may ask
  for). GPU servers are stock V2 servers: they serve whoever reaches them.

``TierTls.load`` reads and checks an instance's files once, when the tier
builds its credentials at start (a missing file, or a certificate naming
another identity, is a ``ConfigError`` naming ``tls.certs``); rotating them
means restarting the tier. ``common.config.pki`` writes the demo PKI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from common.config.access import TlsConfig
from common.config.gpu import GpuConfig
from common.config.identity import GLOBAL, Identity, gpu_servers, local, regional
from common.config.node import ConfigError
from common.config.pki import LOOPBACK_HOSTS
from common.config.topology import Topology, ZoneConfig


def fleet_identities(topology: Topology) -> list[Identity]:
    """Every identity a fleet's PKI must issue: the global tier, each regional and
    local tier, and the GPU servers of each zone with a GPU on the fleet's CA."""
    out = [GLOBAL]
    for region in topology.regions:
        out.append(regional(region.name))
        for zone in region.zones:
            out.append(local(region.name, zone.name))
            if any(g.tls is not None and g.tls.ca is None for g in zone.gpus):
                out.append(gpu_servers(region.name, zone.name))
    return out


def fleet_hosts(topology: Topology) -> tuple[str, ...]:
    """The hosts a fleet's demo PKI names in every certificate: loopback, and each host a
    tier is dialled at (``address``: a parent verifies the name it dialled)."""
    dialled = [topology.global_tier.address.host]
    for region in topology.regions:
        dialled += [region.address.host, *(z.address.host for z in region.zones)]
    wildcard = ("0.0.0.0", "::")  # a bind address, never dialled by name
    extra = [h for h in dict.fromkeys(dialled) if h not in LOOPBACK_HOSTS and h not in wildcard]
    return (*LOOPBACK_HOSTS, *extra)


@dataclass(frozen=True)
class TierTls:
    """One instance's TLS material, read and checked once at start."""

    identity: Identity
    ca: bytes
    cert: bytes
    key: bytes
    client_facing: bool = False

    @classmethod
    def load(cls, tls: TlsConfig, identity: Identity) -> TierTls:
        """``identity``'s files under ``tls.certs``; ConfigError naming the key when one
        is missing, the certificate names another identity, or the key does not match."""
        cert_path, key_path = tls.cert_file(identity), tls.key_file(identity)
        for path in (cert_path, key_path):
            if not path.is_file():
                raise ConfigError(
                    f"tls.certs: no certificate for {identity.uri} ({identity.label}): "
                    f"no such file {str(path)!r}"
                )
        cert, key = cert_path.read_bytes(), key_path.read_bytes()
        _check_pair(identity, cert_path, cert, key)
        return cls(identity, Path(tls.ca).read_bytes(), cert, key, tls.client_facing)

    @property
    def parent(self) -> Identity | None:
        """The only caller this instance serves (None: the edge, which serves clients)."""
        return self.identity.parent

    def server_credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials:
        """Serve with this instance's certificate; with ``require_client_cert``, only
        callers presenting a certificate signed by the fleet's CA complete the handshake."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if require_client_cert else None,
            require_client_auth=require_client_cert,
        )

    def channel_credentials(self, ca: bytes | None = None) -> grpc.ChannelCredentials:
        """Call a peer: verify it against ``ca`` (default: the fleet's), present this
        instance's certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca if ca is None else ca,
            private_key=self.key,
            certificate_chain=self.cert,
        )


def identity_uris(cert_pem: bytes) -> list[str]:
    """The URI SANs of a PEM certificate."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


def _check_pair(identity: Identity, cert_path: Path, cert: bytes, key: bytes) -> None:
    try:
        uris = identity_uris(cert)
        public = load_pem_private_key(key, password=None).public_key()
    except ValueError as exc:
        raise ConfigError(
            f"tls.certs: {cert_path.parent} holds no usable PEM pair: {exc}"
        ) from None
    if uris != [identity.uri]:
        raise ConfigError(
            f"tls.certs: {cert_path} names {uris or 'no URI SAN'}, not this instance's "
            f"identity {identity.uri} ({identity.label})"
        )
    if x509.load_pem_x509_certificate(cert).public_key() != public:
        raise ConfigError(f"tls.certs: {cert_path.parent}/key.pem does not match its cert.pem")


def tier_tls(topology: Topology, identity: Identity) -> TierTls | None:
    """The instance's TLS, or None when the fleet runs plaintext (no ``tls``)."""
    return None if topology.tls is None else TierTls.load(topology.tls, identity)


def tier_server_credentials(tls: TierTls | None, *, edge: bool) -> grpc.ServerCredentials | None:
    """How a tier serves: None (plaintext) without TLS; the edge (global) tier
    server-side TLS only when ``tls.client_facing``; inner tiers mutual TLS."""
    if tls is None or (edge and not tls.client_facing):
        return None
    return tls.server_credentials(require_client_cert=not edge)


def tier_channel_credentials(tls: TierTls | None) -> grpc.ChannelCredentials | None:
    """How a tier calls the tier below: None (plaintext) without TLS, else mutual TLS."""
    return None if tls is None else tls.channel_credentials()


class GpuCredentials:
    """How the local tier dials each GPU: plaintext unless its entry says ``tls``;
    one credentials object per CA file, read once."""

    def __init__(self, tls: TierTls | None) -> None:
        self.tls = tls
        self._by_ca: dict[str | None, grpc.ChannelCredentials] = {}

    def __call__(self, gpu: GpuConfig) -> grpc.ChannelCredentials | None:
        if gpu.tls is None:
            return None
        ca = gpu.tls.ca
        if ca not in self._by_ca:
            if self.tls is not None:
                own_ca = None if ca is None else Path(ca).read_bytes()
                self._by_ca[ca] = self.tls.channel_credentials(own_ca)
            elif ca is not None:  # a plaintext fleet with one TLS GPU: nothing to present
                self._by_ca[ca] = grpc.ssl_channel_credentials(Path(ca).read_bytes())
            else:
                raise ConfigError(f"GPU {gpu.name}: tls: true needs the fleet's tls.ca")
        return self._by_ca[ca]


def gpu_server_credentials(
    topology: Topology,
    region: str,
    zone: ZoneConfig,
    *,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> grpc.ServerCredentials | None:
    """How the emulated GPUs of ``zone`` that say ``tls`` serve (server-side TLS, any
    caller): with ``cert_file``/``key_file`` when given, else with the zone's GPU
    certificate under ``tls.certs``; None when no GPU of the zone serves TLS."""
    tls_gpus = [g for g in zone.gpus if g.tls is not None]
    if not tls_gpus:
        return None
    if cert_file is not None and key_file is not None:
        pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
        return grpc.ssl_server_credentials([pair])
    own_ca = next((g for g in tls_gpus if g.tls is not None and g.tls.ca is not None), None)
    if topology.tls is None or own_ca is not None:
        name = (own_ca or tls_gpus[0]).name
        raise ConfigError(
            f"--tls-cert: GPU {name} serves TLS with a CA this fleet did not generate; "
            "give its certificate and key with --tls-cert and --tls-key"
        )
    keys = TierTls.load(topology.tls, gpu_servers(region, zone.name))
    return keys.server_credentials(require_client_cert=False)
