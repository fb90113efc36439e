"""The gate and spec of an inner tier's OpenAI edge (common.tier.client_entry): keys,
data residency, client regions and trust as the global edge has them."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from common.basics.errors import RouteError
from common.basics.vocabulary import Priority
from common.config.access import AuthConfig, TenantConfig
from common.config.topology import topology_from_mapping
from common.request.proxy import TierSpec
from common.request.routing import CLIENT_REGION, RouteHints, parse_hints
from common.tenancy.admission import Admission
from common.tenancy.auth import Authenticator, hash_key
from common.tier.client_entry import ClientGate, client_front
from tests.common.config.test_config import demo

KEY = "mk_test_key"


def gate(allowed: frozenset[str] = frozenset(), region: str = "eu") -> ClientGate:
    tenant = TenantConfig("acme", frozenset({hash_key(KEY)}), allowed_regions=allowed)
    auth = AuthConfig(enabled=True, tenants=(tenant,))
    return ClientGate(Admission(auth, Authenticator(auth)), region, frozenset({"eu", "us"}))


def hints(metadata: list[tuple[str, str]]) -> RouteHints:
    return parse_hints(metadata, trust_internal=False)


def refused(call: Any) -> RouteError:
    with pytest.raises(RouteError) as caught:
        call()
    return caught.value


def test_a_known_key_is_its_tenant() -> None:
    md = [("authorization", f"Bearer {KEY}")]
    assert gate().identify(md, hints(md)).tenant == "acme"


def test_no_key_or_an_unknown_one_is_unauthenticated() -> None:
    for md in ([], [("authorization", "Bearer mk_other")]):
        err = refused(lambda md=md: gate().identify(md, hints(md)))
        assert err.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_not_allowed_in_this_region_is_permission_denied() -> None:
    md = [("authorization", f"Bearer {KEY}")]
    err = refused(lambda: gate(frozenset({"us"}), region="eu").identify(md, hints(md)))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    assert "only in us;" in err.message and "serves 'eu'" in err.message
    assert gate(frozenset({"eu"}), region="eu").identify(md, hints(md)).tenant == "acme"


def test_the_clients_spec_trusts_nothing_and_checks_the_client_region() -> None:
    spec = TierSpec(tier="local", trust_internal=True, resolve_origin=lambda h: None)
    client = gate().client_spec(spec)
    assert (client.tier, client.trust_internal, client.gpu_children) == ("local", False, False)
    known = hints([(CLIENT_REGION, "us")])
    assert client.resolve_origin(known) is None  # the tier's own resolution after the check
    err = refused(lambda: client.resolve_origin(hints([(CLIENT_REGION, "mars")])))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert CLIENT_REGION in err.message and "eu, us" in err.message


def test_internal_keys_from_a_client_are_not_believed() -> None:
    md = [("x-meridian-tenant", "someone-else"), ("x-meridian-priority", "sheddable")]
    parsed = hints(md)
    assert parsed.tenant == "" and parsed.priority is Priority.SHEDDABLE


def test_a_front_is_built_only_where_openai_listen_is_set() -> None:
    raw = demo()
    region, zone = raw["regions"][0], raw["regions"][0]["zones"][0]
    zone["openai_listen"] = "127.0.0.1:0"
    topo = topology_from_mapping(raw)
    front = client_front(topo, region["name"], zone=zone["name"])
    assert front is not None and front.gate is not None
    assert front.gate.region == region["name"]
    assert front.gate.admission.route_above == region["name"]  # a zone's routes start there
    assert front.gate.admission.usage is not None  # the edge's usage records
    assert client_front(topo, region["name"]) is None
    other = raw["regions"][0]["zones"][1]["name"]
    assert client_front(topo, region["name"], zone=other) is None
    region["openai_listen"] = "127.0.0.1:0"
    front = client_front(topology_from_mapping(raw), region["name"])
    assert front is not None and front.gate is not None
    assert front.gate.admission.route_above == ""  # a region's routes name it already
