"""ParentOnly over real gRPC with real certificates: an inner tier serves its parent only.

A V2 server on mutual TLS, as the regional tier of eu-west serves: the global
tier's certificate is served; a certificate of the same fleet naming another
identity (a local tier, another region) is refused with PERMISSION_DENIED for
unary and streaming calls alike, before the servicer sees anything; health
stays open to any certificate of the fleet.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config.access import TlsConfig
from common.config.identity import GLOBAL, Identity, local, regional
from common.config.node import Endpoint
from common.config.pki import generate_pki
from common.config.tls import TierTls
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.peers import ParentOnly, parent_only
from common.request.routing import TENANT
from common.request.server import V2Server
from common.request.v2 import generate_request, text_response

EU, US = regional("eu-west"), regional("us-east")
EU_1A, US_1A = local("eu-west", "eu-west-1a"), local("us-east", "us-east-1a")


@dataclass
class Recorder(pb_grpc.GRPCInferenceServiceServicer):
    """Answers, and remembers the tenant each call claimed."""

    tenants: list[str] = field(default_factory=list)

    def _claimed(self, context: grpc.aio.ServicerContext) -> None:
        md = dict(context.invocation_metadata() or ())
        self.tenants.append(str(md.get(TENANT, "")))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        self._claimed(context)
        return text_response(request, "served")

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # An async generator: the interceptor must guard this kind of handler too.
        self._claimed(context)
        async for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=text_response(request, "served"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return generate_pki(tmp_path_factory.mktemp("pki"), [GLOBAL, EU, US, EU_1A, US_1A])


@dataclass
class Regional:
    server: V2Server
    recorder: Recorder
    pki: TlsConfig

    def channel(self, identity: Identity) -> grpc.aio.Channel:
        creds = TierTls.load(self.pki, identity).channel_credentials()
        return grpc.aio.secure_channel(self.server.address, creds)


@pytest.fixture
async def eu(pki: TlsConfig) -> AsyncIterator[Regional]:
    """A server standing for the regional tier of eu-west."""
    recorder = Recorder()
    server = V2Server(
        recorder,
        Endpoint("127.0.0.1", 0),
        credentials=TierTls.load(pki, EU).server_credentials(require_client_cert=True),
        interceptors=parent_only(EU),
    )
    await server.start()
    await server.set_serving(True)
    try:
        yield Regional(server, recorder, pki)
    finally:
        await server.stop(0)


FORGED = [(TENANT, "acme")]


async def test_the_parent_is_served_and_believed(eu: Regional) -> None:
    async with eu.channel(GLOBAL) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(generate_request("m", "hi"), metadata=FORGED, timeout=5)
    assert eu.recorder.tenants == ["acme"]


@pytest.mark.parametrize("caller", [EU_1A, US, US_1A], ids=str)
async def test_another_identity_of_the_fleet_is_refused_before_the_handler(
    eu: Regional, caller: Identity
) -> None:
    async with eu.channel(caller) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ModelInfer(generate_request("m", "hi"), metadata=FORGED, timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    details = err.value.details() or ""
    assert details.startswith(
        "the regional tier of eu-west serves only its parent, the global tier "
        "(spiffe://meridian/global)"
    )
    assert details.endswith(f"the caller is {caller.uri}")
    assert eu.recorder.tenants == []  # the forged tenant never reached the servicer


async def test_calls_without_internal_metadata_are_refused_too(eu: Regional) -> None:
    async with eu.channel(EU_1A) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ModelInfer(generate_request("m", "hi"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert eu.recorder.tenants == []


async def test_streams_are_guarded_like_unary_calls(eu: Regional) -> None:
    async with eu.channel(US_1A) as channel:
        # Refused as the stream opens, before any request is read. (Nothing is written:
        # a write racing with the refusal may surface on the client as INTERNAL.)
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            metadata=FORGED, timeout=5
        )
        assert await call.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await call.details()).endswith(f"the caller is {US_1A.uri}")
    assert eu.recorder.tenants == []
    requests = [generate_request("m", "hi"), generate_request("m", "there")]
    async with eu.channel(GLOBAL) as channel:
        stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter(requests), metadata=FORGED, timeout=5
        )
        assert len([r async for r in stream]) == 2
    assert eu.recorder.tenants == ["acme"]


async def test_health_stays_open_to_any_certificate_of_the_fleet(eu: Regional) -> None:
    async with eu.channel(US_1A) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_only_inner_tiers_are_kept_to_a_parent() -> None:
    assert parent_only(None) == [] and parent_only(GLOBAL) == []
    [check] = parent_only(EU_1A)
    assert isinstance(check, ParentOnly) and check.parent == EU


def _ca_and_leaf_without_identity() -> tuple[bytes, bytes, bytes]:
    """A CA, and a certificate+key it signed with no URI SAN: (ca, key, cert) as PEM."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "an older CA")])

    def signed(subject: x509.Name, public: Any, *, ca: bool) -> x509.Certificate:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), True)
            .sign(ca_key, hashes.SHA256())
        )

    leaf_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meridian-tier")])
    ca_cert = signed(issuer, ca_key.public_key(), ca=True)
    leaf = signed(leaf_name, key.public_key(), ca=False)
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ca_cert.public_bytes(pem), key_pem, leaf.public_bytes(pem)


async def test_a_certificate_without_an_identity_is_refused_saying_so(eu: Regional) -> None:
    """A verified certificate that names no identity (one issued before identities
    existed) is refused like a wrong one."""
    old_ca, key, cert = _ca_and_leaf_without_identity()
    eu_keys = TierTls.load(eu.pki, EU)
    server = V2Server(
        Recorder(),
        Endpoint("127.0.0.1", 0),
        credentials=grpc.ssl_server_credentials(
            [(eu_keys.key, eu_keys.cert)],
            root_certificates=eu_keys.ca + old_ca,
            require_client_auth=True,
        ),
        interceptors=parent_only(EU),
    )
    await server.start()
    try:
        creds = grpc.ssl_channel_credentials(eu_keys.ca, key, cert)
        async with grpc.aio.secure_channel(server.address, creds) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ModelInfer(generate_request("m", "hi"), metadata=FORGED, timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (err.value.details() or "").endswith(
            "the caller is a certificate that names no Meridian identity"
        )
    finally:
        await server.stop(0)
