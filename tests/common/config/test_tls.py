"""common/tls.py: the generated PKI, and a V2 server that requires a client certificate."""

from __future__ import annotations

import ipaddress
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.config.access import TlsConfig
from common.config.node import Endpoint
from common.config.tls import (
    channel_credentials,
    generate_pki,
    server_credentials,
    tier_channel_credentials,
    tier_server_credentials,
)
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.server import V2Server


def _cert(path: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return generate_pki(tmp_path_factory.mktemp("pki"))


def test_tier_certificate_is_signed_by_the_ca(pki: TlsConfig) -> None:
    ca, tier = _cert(pki.ca), _cert(pki.cert)
    tier.verify_directly_issued_by(ca)
    ca.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not tier.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_certificate_from_another_ca_does_not_verify(pki: TlsConfig, tmp_path: Path) -> None:
    other = generate_pki(tmp_path / "other")
    with pytest.raises(Exception):  # noqa: B017 - cryptography raises InvalidSignature or ValueError
        _cert(other.cert).verify_directly_issued_by(_cert(pki.ca))


def test_tier_certificate_names_the_loopback_hosts(pki: TlsConfig) -> None:
    san = _cert(pki.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    }
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]


def test_tier_certificate_is_for_server_and_client(pki: TlsConfig) -> None:
    eku = _cert(pki.cert).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_custom_hosts_become_sans(tmp_path: Path) -> None:
    tls = generate_pki(tmp_path, hosts=("regional.meridian.svc", "10.0.0.7"))
    san = _cert(tls.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["regional.meridian.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]


def test_key_file_is_private_and_matches_the_certificate(pki: TlsConfig) -> None:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    assert stat.S_IMODE(Path(pki.key).stat().st_mode) == 0o600
    key = load_pem_private_key(Path(pki.key).read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key() == _cert(pki.cert).public_key()
    assert pki.client_facing is False


def test_regenerating_replaces_the_files_and_keeps_the_key_private(tmp_path: Path) -> None:
    first = generate_pki(tmp_path)
    old = Path(first.cert).read_bytes()
    second = generate_pki(tmp_path)
    assert second == first
    assert Path(second.cert).read_bytes() != old
    assert stat.S_IMODE(Path(second.key).stat().st_mode) == 0o600


def test_tier_credentials_by_role(pki: TlsConfig) -> None:
    from dataclasses import replace

    assert tier_server_credentials(None, edge=True) is None
    assert tier_server_credentials(None, edge=False) is None
    assert tier_channel_credentials(None) is None
    assert tier_server_credentials(pki, edge=True) is None  # the edge stays plaintext
    client_facing = replace(pki, client_facing=True)
    assert isinstance(tier_server_credentials(client_facing, edge=True), grpc.ServerCredentials)
    assert isinstance(tier_server_credentials(pki, edge=False), grpc.ServerCredentials)
    assert isinstance(tier_channel_credentials(pki), grpc.ChannelCredentials)


# -- a real server on loopback ------------------------------------------------------------


class _Ready(pb_grpc.GRPCInferenceServiceServicer):
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)


def _ca_only(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Verify the server against the CA, but present no client certificate."""
    return grpc.ssl_channel_credentials(root_certificates=Path(tls.ca).read_bytes())


def _presenting(trust: TlsConfig, identity: TlsConfig) -> grpc.ChannelCredentials:
    """Verify the server against ``trust``'s CA, present ``identity``'s certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(trust.ca).read_bytes(),
        private_key=Path(identity.key).read_bytes(),
        certificate_chain=Path(identity.cert).read_bytes(),
    )


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
    server = await _start(server_credentials(pki, require_client_cert=True))
    try:
        yield server
    finally:
        await server.stop(0)


async def test_call_with_client_certificate_succeeds(pki: TlsConfig, mtls_server: V2Server) -> None:
    async with grpc.aio.secure_channel(mtls_server.address, channel_credentials(pki)) as ch:
        assert await _ready(ch)


async def test_call_by_localhost_name_succeeds(pki: TlsConfig, mtls_server: V2Server) -> None:
    address = f"localhost:{mtls_server.port}"
    async with grpc.aio.secure_channel(address, channel_credentials(pki)) as ch:
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
    rogue = generate_pki(tmp_path)
    # Trusts the real server, but presents a certificate the server's CA did not sign.
    creds = _presenting(pki, rogue)
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
    server = await _start(server_credentials(pki, require_client_cert=False))
    try:
        async with grpc.aio.secure_channel(server.address, _ca_only(pki)) as ch:
            assert await _ready(ch)
    finally:
        await server.stop(0)


async def test_client_rejects_a_server_from_another_ca(pki: TlsConfig, tmp_path: Path) -> None:
    rogue = generate_pki(tmp_path)
    server = await _start(server_credentials(rogue, require_client_cert=False))
    try:
        async with grpc.aio.secure_channel(server.address, channel_credentials(pki)) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _ready(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_files_are_read_once(tmp_path: Path) -> None:
    """Credentials built at start keep working when the files go away afterwards."""
    tls = generate_pki(tmp_path)
    server_creds = server_credentials(tls, require_client_cert=True)
    client_creds = channel_credentials(tls)
    _remove(tls)
    server = await _start(server_creds)
    try:
        async with grpc.aio.secure_channel(server.address, client_creds) as ch:
            assert await _ready(ch)
    finally:
        await server.stop(0)


def _remove(tls: TlsConfig) -> None:
    for path in (tls.ca, tls.cert, tls.key):
        Path(path).unlink()
