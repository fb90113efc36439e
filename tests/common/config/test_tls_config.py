"""The topology's ``tls`` section and a GPU's ``tls``: every bad value is refused at start
with an error naming its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.config.identity import gpu_servers, parse_identity, regional
from common.config.node import ConfigError
from common.config.pki import FleetCA
from common.config.tls import fleet_identities
from common.config.topology import Topology, topology_from_mapping
from sim.topology import one_zone_mapping


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> FleetCA:
    return FleetCA.create(tmp_path_factory.mktemp("pki"))


def mapping(ca: FleetCA | None, **tls: Any) -> dict[str, Any]:
    raw = one_zone_mapping("redis://127.0.0.1:1/0", gpus=2, region="eu-west", zone="eu-west-1a")
    if ca is not None:
        raw["tls"] = {"ca": ca.tls.ca, "certs": ca.tls.certs, **tls}
    return raw


def refused(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(raw)
    return str(err.value)


def gpu(raw: dict[str, Any], i: int) -> dict[str, Any]:
    entry: dict[str, Any] = raw["regions"][0]["zones"][0]["gpus"][i]
    return entry


def test_the_tls_section_names_a_ca_and_a_directory_of_instance_certificates(ca: FleetCA) -> None:
    topology = topology_from_mapping(mapping(ca, client_facing=True))
    assert topology.tls is not None
    assert (topology.tls.ca, topology.tls.certs) == (ca.tls.ca, ca.tls.certs)
    assert topology.tls.client_facing
    assert topology.tls.cert_file(regional("eu-west")) == Path(
        ca.tls.certs, "regional", "eu-west", "cert.pem"
    )


@pytest.mark.parametrize("key", ["cert", "key"])
def test_one_shared_certificate_is_refused_naming_the_key(ca: FleetCA, key: str) -> None:
    message = refused(mapping(ca, **{key: ca.tls.ca}))
    assert message.startswith(f"tls.{key}: one certificate for every tier is no longer accepted")
    assert "tls.certs" in message


def test_a_missing_ca_or_certs_directory_is_named(ca: FleetCA, tmp_path: Path) -> None:
    raw = mapping(ca)
    raw["tls"]["ca"] = str(tmp_path / "nope.pem")
    assert refused(raw).startswith("tls.ca: no such file")
    raw = mapping(ca)
    raw["tls"]["certs"] = str(tmp_path / "nope")
    assert refused(raw).startswith("tls.certs: no such directory")
    raw = mapping(ca)
    del raw["tls"]["certs"]
    assert refused(raw) == "tls.certs: required key is missing"


def test_names_that_cannot_be_part_of_an_identity_are_refused_with_tls(ca: FleetCA) -> None:
    raw = mapping(ca)
    raw["regions"][0]["zones"][0]["name"] = "eu/west 1a"
    message = refused(raw)
    assert message.startswith("regions[0].zones[0].name: 'eu/west 1a' cannot name a TLS identity")
    # A fleet without TLS has no identities: the name is fine there.
    raw.pop("tls")
    assert topology_from_mapping(raw).regions[0].zones[0].name == "eu/west 1a"


def test_a_gpu_serves_plaintext_unless_it_says_tls(ca: FleetCA) -> None:
    raw = mapping(ca)
    gpu(raw, 1)["tls"] = True
    topology: Topology = topology_from_mapping(raw)
    g0, g1 = topology.zone("eu-west", "eu-west-1a").gpus
    assert g0.tls is None
    assert g1.tls is not None and g1.tls.ca is None  # the fleet's CA
    assert gpu_servers("eu-west", "eu-west-1a") in fleet_identities(topology)
    gpu(raw, 1)["tls"] = {"ca": ca.tls.ca}
    g1 = topology_from_mapping(raw).zone("eu-west", "eu-west-1a").gpus[1]
    assert g1.tls is not None and g1.tls.ca == ca.tls.ca


def test_bad_gpu_tls_values_are_named(ca: FleetCA, tmp_path: Path) -> None:
    raw = mapping(None)
    gpu(raw, 0)["tls"] = True
    message = refused(raw)
    assert message.startswith("regions[0].zones[0].gpus[0].tls: true needs the fleet's CA")
    gpu(raw, 0)["tls"] = {"ca": str(tmp_path / "nope.pem")}
    assert refused(raw).startswith("regions[0].zones[0].gpus[0].tls.ca: no such file")
    gpu(raw, 0)["tls"] = {"ca": ca.tls.ca, "cert": "x"}
    assert refused(raw) == "regions[0].zones[0].gpus[0].tls.cert: unknown key"
    gpu(raw, 0)["tls"] = "yes"
    assert refused(raw).startswith("regions[0].zones[0].gpus[0].tls: expected")


@pytest.mark.parametrize(
    "uri",
    [
        "spiffe://meridian/regional",
        "spiffe://meridian/regional/a/b",
        "spiffe://other/regional/eu-west",
        "spiffe://meridian/local/eu-west/..",
        "spiffe://meridian/admin",
        "https://meridian/global",
    ],
)
def test_uris_that_are_not_fleet_identities_parse_as_none(uri: str) -> None:
    assert parse_identity(uri) is None


def test_an_identity_uri_parses_back() -> None:
    identity = regional("eu-west")
    assert parse_identity(identity.uri) == identity
