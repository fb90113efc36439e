"""Trust between tiers: a fleet on mutual TLS serves each inner tier to its parent only.

One small fleet (1 region, 1 zone, 1 GPU), each tier its own process, as
``meridian up`` starts it: the global endpoint is plaintext for clients; every
tier instance has its own certificate, and the regional and local tiers accept
only callers presenting their parent's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from cli.launcher import Fleet
from common.config.identity import GLOBAL, local, regional
from common.config.tls import fleet_identities, identity_uris
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import ROUTE, trailer
from common.request.v2 import generate_request, response_text
from tests.client import V2Client
from tests.conftest import small_fleet_spec, start_fleet

INNER_TIERS = ("regional-us-east", "local-us-east-1a")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Shared by this module's tests, which only read it."""
    fleet = start_fleet(tmp_path_factory.mktemp("mtls"), small_fleet_spec(1, 1, 1))
    try:
        yield fleet
    finally:
        fleet.stop()


def _infer(channel: grpc.Channel) -> tuple[str, str]:
    """One small generate request; the text and the route trailer."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    response, call = stub.ModelInfer.with_call(
        generate_request("demo-llm", "who may call me", 2), timeout=10
    )
    return response_text(response), trailer(call.trailing_metadata(), ROUTE) or ""


def _refused(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        _infer(channel)
    return err.value


@pytest.fixture
def channels(
    fleet: Fleet,
) -> Iterator[Callable[[str, grpc.ChannelCredentials | None], grpc.Channel]]:
    """Open channels to fleet processes; all closed at the end."""
    opened: list[grpc.Channel] = []

    def open_channel(name: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
        address = fleet.endpoint_of(name)
        channel = (
            grpc.insecure_channel(address)
            if credentials is None
            else grpc.secure_channel(address, credentials)
        )
        opened.append(channel)
        return channel

    try:
        yield open_channel
    finally:
        for channel in opened:
            channel.close()


def test_fleet_runs_mutual_tls_between_tiers(fleet: Fleet) -> None:
    tls = fleet.topology.tls
    assert tls is not None and not tls.client_facing
    assert Path(tls.certs).parent == fleet.run_dir / "pki"
    # One certificate per tier instance, each naming its own identity.
    for identity in fleet_identities(fleet.topology):
        assert identity_uris(tls.cert_file(identity).read_bytes()) == [identity.uri]
    assert fleet_identities(fleet.topology) == [
        GLOBAL,
        regional("us-east"),
        local("us-east", "us-east-1a"),
    ]
    # The client-facing endpoint stays plaintext: clients authenticate with API keys.
    with V2Client(fleet.global_address) as client:
        reply = client.infer("through every tier", 3)
    assert reply.route.startswith("us-east/us-east-1a/") and reply.text


@pytest.mark.parametrize("name", INNER_TIERS)
def test_plaintext_call_to_an_inner_tier_is_refused(
    name: str, channels: Callable[[str, grpc.ChannelCredentials | None], grpc.Channel]
) -> None:
    error = _refused(channels(name, None))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("name", INNER_TIERS)
def test_tls_call_without_client_certificate_is_refused(
    name: str,
    fleet: Fleet,
    channels: Callable[[str, grpc.ChannelCredentials | None], grpc.Channel],
) -> None:
    assert fleet.topology.tls is not None
    ca_only = grpc.ssl_channel_credentials(Path(fleet.topology.tls.ca).read_bytes())
    error = _refused(channels(name, ca_only))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("name", INNER_TIERS)
def test_call_with_the_parents_certificate_is_served(
    name: str,
    fleet: Fleet,
    channels: Callable[[str, grpc.ChannelCredentials | None], grpc.Channel],
) -> None:
    """The refusals above are about identity: the same call as the tier's parent works."""
    text, route = _infer(channels(name, fleet.credentials_for(name)))
    assert text
    assert "us-east-1a/" in route


def test_a_forged_tenant_from_the_local_tiers_certificate_is_refused_by_the_regional(
    fleet: Fleet,
    channels: Callable[[str, grpc.ChannelCredentials | None], grpc.Channel],
) -> None:
    """Whoever holds the local tier's key cannot speak for the global tier: the regional
    tier refuses its call, internal metadata and all, naming both identities."""
    forger = fleet.credentials_as(local("us-east", "us-east-1a"))
    stub = pb_grpc.GRPCInferenceServiceStub(channels("regional-us-east", forger))
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(
            generate_request("demo-llm", "as someone else", 2),
            metadata=[("x-meridian-tenant", "demo")],
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    details = err.value.details() or ""
    assert "the regional tier of us-east serves only its parent" in details
    assert details.endswith("the caller is spiffe://meridian/local/us-east/us-east-1a")


def test_fleet_without_tls_is_plaintext_everywhere(tmp_path: Path) -> None:
    """``Fleet(tls=False)`` generates no PKI; nothing is started here."""
    spec = tmp_path / "fleet.yaml"
    spec.write_text(yaml.safe_dump(small_fleet_spec(1, 1, 1)))
    fleet = Fleet(spec, tmp_path / "run", redis_url="redis://127.0.0.1:1/0", tls=False)
    assert fleet.topology.tls is None
    assert not (tmp_path / "run" / "pki").exists()
    assert all(fleet.credentials_for(name) is None for name in fleet.processes)


def test_a_gpu_that_says_tls_is_dialled_over_tls(tmp_path: Path) -> None:
    """``meridian up`` issues the zone's GPU certificate, the worker serves TLS with it,
    the local tier dials it with TLS; a plaintext call to the GPU fails."""
    spec = small_fleet_spec(1, 1, 1)
    spec["regions"][0]["zones"][0]["gpus"][0]["tls"] = True
    fleet = start_fleet(tmp_path, spec)
    try:
        with V2Client(fleet.global_address) as client:
            reply = client.infer("over tls to the gpu", 3)
        assert reply.route.startswith("us-east/us-east-1a/") and reply.text
        gpu = fleet.topology.regions[0].zones[0].gpus[0]
        with grpc.insecure_channel(gpu.endpoint.address) as channel:
            error = _refused(channel)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        fleet.stop()
