"""Trust between tiers: mutual TLS, and the demo PKI ``meridian up`` and the tests use.

Routing metadata between tiers (tenant, origin, prefix hashes, attempt) is
trusted only because the caller proved, in the TLS handshake, that it holds a
certificate signed by the fleet's CA. So:

- the regional and local tiers serve with mutual TLS: a caller without a
  client certificate signed by ``tls.ca`` fails the handshake (UNAVAILABLE) and
  never reaches the proxy;
- the global tier serves plaintext, or server-side TLS when
  ``tls.client_facing`` (clients authenticate with API keys, not certificates);
- global → regional and regional → local channels present the tier
  certificate; local → GPU channels stay plaintext (GPU workers are stock V2
  servers outside the router's trust domain).

Every tier uses the same certificate, as server and as client (EKU serverAuth
and clientAuth): the identity proven is "a Meridian tier of this fleet", which
is all that trusting internal metadata needs. Files are read once, when a tier
builds its credentials at start; rotating them means restarting the tier.

``generate_pki`` writes a fresh self-signed CA and one tier certificate for
loopback (the demo fleet and the tests). The CA's private key is never
written: nothing can issue further certificates for this fleet.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.config.access import TlsConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CA_FILE = "ca.pem"
CERT_FILE = "tier.pem"
KEY_FILE = "tier-key.pem"
# Tolerate a little clock skew between the machine that generates and the ones that verify.
_BACKDATE = datetime.timedelta(hours=1)
_VALIDITY = datetime.timedelta(days=365)


def generate_pki(directory: Path, *, hosts: Iterable[str] = LOOPBACK_HOSTS) -> TlsConfig:
    """Write a new CA certificate and a tier certificate+key it signs into ``directory``.

    The tier certificate names every entry of ``hosts`` in its subjectAltName
    (IP addresses as IP SANs, anything else as DNS names) and serves both as
    server and client certificate. The key file is mode 0600. Returns the
    ``TlsConfig`` naming the files (``client_facing`` False).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - _BACKDATE, now + _VALIDITY)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key, validity)
    tier_key = ec.generate_private_key(ec.SECP256R1())
    tier_cert = _tier_certificate(tier_key, ca_key, validity, hosts)

    pem = serialization.Encoding.PEM
    tls = TlsConfig(
        ca=str(directory / CA_FILE),
        cert=str(directory / CERT_FILE),
        key=str(directory / KEY_FILE),
    )
    _write(Path(tls.ca), ca_cert.public_bytes(pem), 0o644)
    _write(Path(tls.cert), tier_cert.public_bytes(pem), 0o644)
    key_pem = tier_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(Path(tls.key), key_pem, 0o600)
    return tls


_CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Meridian fleet CA")])
Validity = tuple[datetime.datetime, datetime.datetime]


def _ca_certificate(ca_key: ec.EllipticCurvePrivateKey, validity: Validity) -> x509.Certificate:
    """The fleet CA: self-signed, may sign tier certificates only (path length 0)."""
    not_before, not_after = validity
    return (
        x509.CertificateBuilder()
        .subject_name(_CA_NAME)
        .issuer_name(_CA_NAME)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )


def _tier_certificate(
    tier_key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    validity: Validity,
    hosts: Iterable[str],
) -> x509.Certificate:
    """The tier certificate the CA signs: server and client auth, ``hosts`` as SANs."""
    not_before, not_after = validity
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meridian-tier")]))
        .issuer_name(_CA_NAME)
        .public_key(tier_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(_san_entries(hosts)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )


def server_credentials(tls: TlsConfig, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """Serve with the tier certificate; with ``require_client_cert``, only callers
    presenting a certificate signed by ``tls.ca`` complete the handshake."""
    key, cert = _read(tls.key), _read(tls.cert)
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=_read(tls.ca) if require_client_cert else None,
        require_client_auth=require_client_cert,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Call a tier: verify it against ``tls.ca`` and present the tier certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )


def tier_server_credentials(tls: TlsConfig | None, *, edge: bool) -> grpc.ServerCredentials | None:
    """How a tier serves: None (plaintext) without TLS; the edge (global) tier
    server-side TLS only when ``tls.client_facing``; inner tiers mutual TLS."""
    if tls is None or (edge and not tls.client_facing):
        return None
    return server_credentials(tls, require_client_cert=not edge)


def tier_channel_credentials(tls: TlsConfig | None) -> grpc.ChannelCredentials | None:
    """How a tier calls the tier below: None (plaintext) without TLS, else mutual TLS."""
    return None if tls is None else channel_credentials(tls)


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _san_entries(hosts: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    if not entries:
        raise ValueError("generate_pki: hosts is empty; the certificate would name no host")
    return entries


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` so that the file never exists with a wider mode than ``mode``."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # exactly ``mode``, whatever the umask
        f.write(data)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
