"""The demo PKI ``meridian up`` and the tests use: one fleet CA, one certificate per instance.

``FleetCA.create`` writes a fresh self-signed CA certificate and an empty
``certs`` directory; ``issue`` writes, for each identity
(``common.config.identity``), ``certs/<identity path>/cert.pem`` and
``key.pem`` (mode 0600). A tier certificate carries its identity as a URI SAN
and the hosts it is reached at (loopback by default) as IP and DNS SANs, for
hostname verification; tiers' certificates serve as server and client
certificate (EKU serverAuth and clientAuth), GPU servers' as server only. The
CA's private key lives only in the ``FleetCA`` object and is never written:
once the launcher is done, nothing can issue further certificates for the fleet.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.config.access import TlsConfig
from common.config.identity import Identity

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CA_FILE = "ca.pem"
CERTS_DIR = "certs"
# Tolerate a little clock skew between the machine that generates and the ones that verify.
_BACKDATE = datetime.timedelta(hours=1)
_VALIDITY = datetime.timedelta(days=365)
_CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Meridian fleet CA")])
Validity = tuple[datetime.datetime, datetime.datetime]


class FleetCA:
    """A new CA whose certificate is in ``directory``; ``issue`` signs instance certificates."""

    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, validity: Validity):
        self.directory = directory
        self._key = key
        self._validity = validity
        self.tls = TlsConfig(ca=str(directory / CA_FILE), certs=str(directory / CERTS_DIR))

    @classmethod
    def create(cls, directory: Path | str) -> FleetCA:
        """Write a fresh CA certificate and an empty ``certs`` directory into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        now = datetime.datetime.now(datetime.UTC)
        ca = cls(
            directory, ec.generate_private_key(ec.SECP256R1()), (now - _BACKDATE, now + _VALIDITY)
        )
        _write(Path(ca.tls.ca), _ca_certificate(ca._key, ca._validity).public_bytes(_PEM), 0o644)
        Path(ca.tls.certs).mkdir(mode=0o700, exist_ok=True)
        return ca

    def issue(
        self, identities: Iterable[Identity], *, hosts: Iterable[str] = LOOPBACK_HOSTS
    ) -> None:
        """Write a certificate and key for each of ``identities``, naming ``hosts`` too."""
        names = _san_entries(hosts)
        for identity in identities:
            key = ec.generate_private_key(ec.SECP256R1())
            cert = self._certificate(identity, key, names)
            folder = self.tls.cert_file(identity).parent
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write(self.tls.cert_file(identity), cert.public_bytes(_PEM), 0o644)
            key_pem = key.private_bytes(
                _PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            _write(self.tls.key_file(identity), key_pem, 0o600)

    def _certificate(
        self, identity: Identity, key: ec.EllipticCurvePrivateKey, hosts: list[x509.GeneralName]
    ) -> x509.Certificate:
        """Signed by the CA: the identity's URI and ``hosts`` as SANs; a tier's is for
        server and client auth, a GPU server's for server auth only."""
        not_before, not_after = self._validity
        usages = [ExtendedKeyUsageOID.SERVER_AUTH]
        if identity.kind != "gpu":
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        sans = [x509.UniformResourceIdentifier(identity.uri), *hosts]
        return (
            x509.CertificateBuilder()
            # The URI SAN is the identity; the CN (at most 64 characters) only helps a reader.
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.uri[:64])]))
            .issuer_name(_CA_NAME)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), False
            )
            .sign(self._key, hashes.SHA256())
        )


def generate_pki(
    directory: Path | str, identities: Iterable[Identity], *, hosts: Iterable[str] = LOOPBACK_HOSTS
) -> TlsConfig:
    """A new CA in ``directory`` and a certificate+key for each of ``identities``
    (``common.config.tls.fleet_identities`` lists a topology's); the ``TlsConfig``
    naming them (``client_facing`` False)."""
    ca = FleetCA.create(directory)
    ca.issue(identities, hosts=hosts)
    return ca.tls


_PEM = serialization.Encoding.PEM


def _ca_certificate(ca_key: ec.EllipticCurvePrivateKey, validity: Validity) -> x509.Certificate:
    """The fleet CA: self-signed, may sign instance certificates only (path length 0)."""
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
        raise ValueError("generate_pki: hosts is empty; the certificates would name no host")
    return entries


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` so that the file never exists with a wider mode than ``mode``."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # exactly ``mode``, whatever the umask
        f.write(data)
