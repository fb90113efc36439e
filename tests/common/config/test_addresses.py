"""``address`` (where a parent dials a tier), ``dns`` and ``keepalive.max_connection_age_s``."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from common.config.liveness import DEFAULT_MAX_CONNECTION_AGE_S
from common.config.node import ConfigError, Endpoint
from common.config.pki import LOOPBACK_HOSTS
from common.config.tls import fleet_hosts
from common.config.topology import Topology, topology_from_mapping
from common.request.keepalive import keepalive_server_args
from common.request.replicas import replica_channel_options, replica_target
from sim.topology import one_zone_mapping

BASE = one_zone_mapping("redis://127.0.0.1:1/0", region_listen="0.0.0.0:9002")


def load(edit: dict[str, Any] | None = None, **settings: Any) -> Topology:
    raw = copy.deepcopy(BASE)
    raw.update(settings)
    for key, value in (edit or {}).items():
        node: Any = raw
        *path, last = key.split(".")
        for part in path:
            node = node[int(part)] if part.isdigit() else node[part]
        node[last] = value
    return topology_from_mapping(raw)


def test_address_defaults_to_where_the_tier_listens() -> None:
    topo = load()
    region, zone = topo.regions[0], topo.regions[0].zones[0]
    assert region.address == region.endpoint == Endpoint("0.0.0.0", 9002)
    assert zone.address == zone.endpoint
    assert topo.global_tier.address == topo.global_tier.endpoint
    assert topo.dns == "dns:///"


def test_address_is_apart_from_listen() -> None:
    topo = load(
        {
            "regions.0.address": "meridian-regional-r.meridian.svc.cluster.local:8001",
            "regions.0.zones.0.address": "[::1]:8101",
            "global.address": "10.0.0.7:8001",
        }
    )
    region = topo.regions[0]
    assert region.endpoint == Endpoint("0.0.0.0", 9002)  # still binds there
    assert region.address == Endpoint("meridian-regional-r.meridian.svc.cluster.local", 8001)
    assert region.zones[0].address == Endpoint("::1", 8101)
    assert topo.global_tier.address == Endpoint("10.0.0.7", 8001)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"regions.0.address": "regional"}, r"^regions\[0\]\.address: expected 'host:port'"),
        ({"regions.0.address": "r.svc:99999"}, r"^regions\[0\]\.address: expected 'host:port'"),
        ({"regions.0.address": "r.svc:0"}, r"^regions\[0\]\.address: a parent cannot dial port 0"),
        (
            {"regions.0.zones.0.address": "bad_name!:80"},
            r"^regions\[0\]\.zones\[0\]\.address: 'bad_name!' is neither an IP",
        ),
        ({"regions.0.zones.0.address": 8001}, r"^regions\[0\]\.zones\[0\]\.address: expected str"),
        ({"global.address": "-lead.example:80"}, r"^global\.address: '-lead\.example' is neither"),
    ],
    ids=["no-port", "port-range", "port-zero", "bad-host", "not-text", "bad-label"],
)
def test_a_bad_address_names_its_key(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(edit)


def test_dns_names_a_name_server() -> None:
    assert load(dns="dns://127.0.0.1:5353/").dns == "dns://127.0.0.1:5353/"
    assert load(dns="dns://[::1]:53/").dns == "dns://[::1]:53/"


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1:53", "dns://127.0.0.1:53", "dns://127.0.0.1:0/", "dns://ns.example:53/", "dns://"],
)
def test_a_bad_dns_setting_names_its_key(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^dns: expected"):
        load(dns=text)


def test_max_connection_age_is_a_server_setting_of_tiers() -> None:
    assert load().liveness.keepalive.max_connection_age_s == DEFAULT_MAX_CONNECTION_AGE_S == 300
    keepalive = load(keepalive={"max_connection_age_s": 30}).liveness.keepalive
    assert keepalive.max_connection_age_s == 30.0
    assert dict(keepalive_server_args(keepalive))["grpc.max_connection_age_ms"] == 30_000
    with pytest.raises(ConfigError, match=r"^keepalive\.max_connection_age_s: must be >= 1\.0"):
        load(keepalive={"max_connection_age_s": 0.5})
    # GPU servers are not Meridian's: their connection age is their own setting.
    with pytest.raises(ConfigError, match=r"^gpu_keepalive\.max_connection_age_s: unknown key"):
        load(gpu_keepalive={"max_connection_age_s": 30})


def test_a_name_is_dialled_round_robin_through_the_dns_resolver() -> None:
    address = Endpoint("meridian-local-a.meridian.svc.cluster.local", 8001)
    assert replica_target(address, "dns:///") == f"dns:///{address}"
    assert replica_target(Endpoint("::1", 80), "dns://127.0.0.1:53/") == "dns://127.0.0.1:53/[::1]:80"
    options = dict(replica_channel_options())
    assert '"round_robin"' in str(options["grpc.service_config"])


def test_the_demo_pki_names_every_host_a_tier_is_dialled_at() -> None:
    topo = load(
        {
            "regions.0.address": "regional.example.test:8001",
            "regions.0.zones.0.address": "10.0.0.9:8101",
        }
    )
    hosts = fleet_hosts(topo)
    assert hosts[:3] == LOOPBACK_HOSTS  # and each once
    assert {"regional.example.test", "10.0.0.9"} <= set(hosts)
    # A region without an address is dialled where it binds: 0.0.0.0 is no host to name.
    assert fleet_hosts(load()) == LOOPBACK_HOSTS
    assert len(hosts) == len(set(hosts))
