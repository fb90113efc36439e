"""common/config/pki.py and tls.py: the generated PKI (one certificate per tier instance),
loading an instance's files, and a V2 server that requires a client certificate."""

from __future__ import annotations

import ipaddress
import shutil
import stat
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.config.access import TlsConfig
from common.config.identity import GLOBAL, Identity, gpu_servers, local, regional
from common.config.node import ConfigError, Endpoint
from common.config.pki import generate_pki
from common.config.tls import (
    TierTls,
    fleet_identities,
    tier_channel_credentials,
    tier_server_credentials,
)
from common.config.topology import topology_from_mapping
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2Server
from sim.topology import one_zone_mapping

EU, EU_1A = regional("eu-west"), local("eu-west", "eu-west-1a")
IDENTITIES = (GLOBAL, EU, EU_1A)


def _cert(path: str | Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def _san(path: str | Path) -> x509.SubjectAlternativeName:
    return _cert(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return generate_pki(tmp_path_factory.mktemp("pki"), IDENTITIES)


@pytest.mark.parametrize("identity", IDENTITIES, ids=str)
def test_each_instance_has_its_own_certificate_naming_its_identity(
    pki: TlsConfig, identity: Identity
) -> None:
    path = pki.cert_file(identity)
    assert path == Path(pki.certs, *identity.path, "cert.pem")
    assert _san(path).get_values_for_type(x509.UniformResourceIdentifier) == [identity.uri]
    others = [pki.cert_file(i).read_bytes() for i in IDENTITIES if i != identity]
    assert path.read_bytes() not in others


def test_identities_name_the_instance_and_its_parent() -> None:
    assert GLOBAL.uri == "spiffe://meridian/global" and GLOBAL.parent is None
    assert EU.uri == "spiffe://meridian/regional/eu-west" and EU.parent == GLOBAL
    assert EU_1A.uri == "spiffe://meridian/local/eu-west/eu-west-1a" and EU_1A.parent == EU
    assert gpu_servers("eu-west", "eu-west-1a").parent is None


def test_certificates_are_signed_by_the_ca(pki: TlsConfig) -> None:
    ca = _cert(pki.ca)
    ca.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for identity in IDENTITIES:
        tier = _cert(pki.cert_file(identity))
        tier.verify_directly_issued_by(ca)
        assert not tier.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_certificate_from_another_ca_does_not_verify(pki: TlsConfig, tmp_path: Path) -> None:
    other = generate_pki(tmp_path / "other", [GLOBAL])
    with pytest.raises(Exception):  # noqa: B017 - cryptography raises InvalidSignature or ValueError
        _cert(other.cert_file(GLOBAL)).verify_directly_issued_by(_cert(pki.ca))


def test_certificates_name_the_loopback_hosts_too(pki: TlsConfig) -> None:
    san = _san(pki.cert_file(EU))
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]


def test_tier_certificates_are_for_server_and_client_gpu_ones_for_server(tmp_path: Path) -> None:
    gpus = gpu_servers("eu-west", "eu-west-1a")
    tls = generate_pki(tmp_path, [EU, gpus])
    for identity, usages in (
        (EU, {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),
        (gpus, {ExtendedKeyUsageOID.SERVER_AUTH}),
    ):
        eku = _cert(tls.cert_file(identity)).extensions.get_extension_for_class(
            x509.ExtendedKeyUsage
        )
        assert set(eku.value) == usages


def test_custom_hosts_become_sans(tmp_path: Path) -> None:
    tls = generate_pki(tmp_path, [EU], hosts=("regional.meridian.svc", "10.0.0.7"))
    san = _san(tls.cert_file(EU))
    assert san.get_values_for_type(x509.DNSName) == ["regional.meridian.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]


def test_key_files_are_private_and_match_their_certificates(pki: TlsConfig) -> None:
    for identity in IDENTITIES:
        assert stat.S_IMODE(pki.key_file(identity).stat().st_mode) == 0o600
        key = load_pem_private_key(pki.key_file(identity).read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert key.public_key() == _cert(pki.cert_file(identity)).public_key()
    assert pki.client_facing is False


def test_regenerating_replaces_the_files_and_keeps_the_key_private(tmp_path: Path) -> None:
    first = generate_pki(tmp_path, [EU])
    old = first.cert_file(EU).read_bytes()
    second = generate_pki(tmp_path, [EU])
    assert second == first
    assert second.cert_file(EU).read_bytes() != old
    assert stat.S_IMODE(second.key_file(EU).stat().st_mode) == 0o600


def test_fleet_identities_are_every_tier_instance_and_the_tls_gpu_servers() -> None:
    raw = one_zone_mapping("redis://127.0.0.1:1/0", gpus=2, region="r", zone="r-1a")
    assert fleet_identities(topology_from_mapping(raw)) == [
        GLOBAL,
        regional("r"),
        local("r", "r-1a"),
    ]
    raw["regions"][0]["zones"][0]["gpus"][1]["tls"] = {"ca": __file__}  # its own CA: not ours
    assert gpu_servers("r", "r-1a") not in fleet_identities(topology_from_mapping(raw))


# -- loading an instance's files ------------------------------------------------------------


def test_loading_reads_the_instance_files(pki: TlsConfig) -> None:
    keys = TierTls.load(pki, EU)
    assert keys.identity == EU and keys.parent == GLOBAL
    assert keys.cert == pki.cert_file(EU).read_bytes()
    assert keys.ca == Path(pki.ca).read_bytes()


def test_a_missing_certificate_names_the_key_and_the_identity(pki: TlsConfig) -> None:
    with pytest.raises(ConfigError) as err:
        TierTls.load(pki, regional("ap-southeast"))
    assert str(err.value).startswith("tls.certs: no certificate for spiffe://meridian/regional/")
    assert "ap-southeast/cert.pem" in str(err.value)


def test_another_instances_certificate_is_refused_at_start(tmp_path: Path) -> None:
    tls = generate_pki(tmp_path, [EU, EU_1A])
    # An operator copies the regional tier's files where the local tier's belong.
    for name in ("cert.pem", "key.pem"):
        shutil.copy(tls.cert_file(EU).parent / name, tls.cert_file(EU_1A).parent / name)
    with pytest.raises(ConfigError) as err:
        TierTls.load(tls, EU_1A)
    message = str(err.value)
    assert message.startswith("tls.certs: ")
    assert EU.uri in message and f"not this instance's identity {EU_1A.uri}" in message


def test_a_key_that_does_not_match_is_refused_at_start(tmp_path: Path) -> None:
    tls = generate_pki(tmp_path, [EU, EU_1A])
    shutil.copy(tls.key_file(EU), tls.key_file(EU_1A))
    with pytest.raises(ConfigError, match=r"^tls\.certs: .*key\.pem does not match"):
        TierTls.load(tls, EU_1A)


def test_tier_credentials_by_role(pki: TlsConfig) -> None:
    keys = TierTls.load(pki, EU)
    assert tier_server_credentials(None, edge=True) is None
    assert tier_server_credentials(None, edge=False) is None
    assert tier_channel_credentials(None) is None
    assert tier_server_credentials(keys, edge=True) is None  # the edge stays plaintext
    client_facing = replace(keys, client_facing=True)
    assert isinstance(tier_server_credentials(client_facing, edge=True), grpc.ServerCredentials)
    assert isinstance(tier_server_credentials(keys, edge=False), grpc.ServerCredentials)
    assert isinstance(tier_channel_credentials(keys), grpc.ChannelCredentials)


# -- a real server on loopback ------------------------------------------------------------


class _Ready(pb_grpc.GRPCInferenceServiceServicer):
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)


def _ca_only(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Verify the server against the CA, but present no client certificate."""
    return grpc.ssl_channel_credentials(root_certificates=Path(tls.ca).read_bytes())


async def _start(credentials: grpc.ServerCredentials) -> V2Server:
    server = V2Server(_Ready(), Endpoint("127.0.0.1", 0), credentials=credentials)
    await server.start()
    return server


async def _ready(channel: grpc.aio.Channel) -> bool:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    reply = await stub.ServerReady(pb.ServerReadyRequest(), timeout=5)
    return bool(reply.ready)


@pytest.fixture
async def mtls_server(pki: TlsConfig) -> AsyncIterator[V2Server]:
    server = await _start(TierTls.load(pki, EU).server_credentials(require_client_cert=True))
    try:
        yield server
    finally:
        await server.stop(0)


def _as(pki: TlsConfig, identity: Identity) -> grpc.ChannelCredentials:
    return TierTls.load(pki, identity).channel_credentials()


async def test_call_with_client_certificate_succeeds(pki: TlsConfig, mtls_server: V2Server) -> None:
    async with grpc.aio.secure_channel(mtls_server.address, _as(pki, GLOBAL)) as ch:
        assert await _ready(ch)


async def test_call_by_localhost_name_succeeds(pki: TlsConfig, mtls_server: V2Server) -> None:
    address = f"localhost:{mtls_server.port}"
    async with grpc.aio.secure_channel(address, _as(pki, GLOBAL)) as ch:
        assert await _ready(ch)


async def test_call_without_client_certificate_fails_the_handshake(
    pki: TlsConfig, mtls_server: V2Server
) -> None:
    async with grpc.aio.secure_channel(mtls_server.address, _ca_only(pki)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _ready(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_certificate_from_another_ca_fails_the_handshake(
    pki: TlsConfig, mtls_server: V2Server, tmp_path: Path
) -> None:
    rogue = TierTls.load(generate_pki(tmp_path, [GLOBAL]), GLOBAL)
    # Trusts the real server, but presents a certificate the server's CA did not sign.
    creds = rogue.channel_credentials(ca=TierTls.load(pki, EU).ca)
    async with grpc.aio.secure_channel(mtls_server.address, creds) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _ready(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_call_fails(mtls_server: V2Server) -> None:
    async with grpc.aio.insecure_channel(mtls_server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _ready(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_server_side_tls_accepts_callers_without_certificate(pki: TlsConfig) -> None:
    server = await _start(TierTls.load(pki, GLOBAL).server_credentials(require_client_cert=False))
    try:
        async with grpc.aio.secure_channel(server.address, _ca_only(pki)) as ch:
            assert await _ready(ch)
    finally:
        await server.stop(0)


async def test_client_rejects_a_server_from_another_ca(pki: TlsConfig, tmp_path: Path) -> None:
    rogue = TierTls.load(generate_pki(tmp_path, [EU]), EU)
    server = await _start(rogue.server_credentials(require_client_cert=False))
    try:
        async with grpc.aio.secure_channel(server.address, _as(pki, GLOBAL)) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _ready(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_files_are_read_once(tmp_path: Path) -> None:
    """Credentials built at start keep working when the files go away afterwards."""
    tls = generate_pki(tmp_path / "pki", [GLOBAL, EU])
    server_creds = TierTls.load(tls, EU).server_credentials(require_client_cert=True)
    client_creds = TierTls.load(tls, GLOBAL).channel_credentials()
    shutil.rmtree(tmp_path / "pki")
    server = await _start(server_creds)
    try:
        async with grpc.aio.secure_channel(server.address, client_creds) as ch:
            assert await _ready(ch)
    finally:
        await server.stop(0)
