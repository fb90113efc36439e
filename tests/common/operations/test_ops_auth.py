"""Who may read the ops HTTP (``common.operations.ops_access``): with ``auth.enabled`` on,
/metrics, the probes and the dashboard page are open and the data (/api/*) needs an
operator key; the global's fleet view passes the viewer's key on to the inner tiers.

Real ops servers (a global with its fleet view, a regional and a local tier) on
loopback, called with a real HTTP client; every server is stopped at the end."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import yaml

from cli.k8s.keys import public_auth, resolve_directives
from cli.launcher import DEMO_FLEET, generate_operator_key
from cli.top import Paint, frame
from common.config.node import ConfigError, Endpoint
from common.config.topology import Topology, topology_from_mapping
from common.observability.tier_metrics import TierMetrics
from common.operations.fleet_view import DASHBOARD_HTML, FleetView
from common.operations.ops_access import OpsAccess
from common.operations.ops_http import OpsServer
from common.request.children import Child, ChildSet
from common.tenancy.auth import hash_key
from tests.conftest import small_fleet_spec

OPERATOR_KEY = "mk-operator-test"
TENANT_KEY = "mk-tenant-test"
OPEN = ("/metrics", "/healthz", "/readyz", "/", "/dashboard")
GLOBAL_DATA = (
    "/api/state",
    "/api/series",
    "/api/traces",
    "/api/fleet",
    "/api/fleet/overview",
    "/api/fleet/traces",
)
MISSING = {"error": "missing 'Authorization: Bearer <operator key>' header"}
NOT_BEARER = {"error": "header 'Authorization' must be 'Bearer <operator key>'"}
REFUSED = {"error": "not an operator key (auth.operator_key_sha256)"}


def spec(*, enabled: bool = True, operator_keys: list[str] | None = None) -> dict[str, Any]:
    out = small_fleet_spec(regions=1, zones=1, gpus=1)
    out["auth"] = {
        "enabled": enabled,
        "tenants": [{"id": "demo", "api_key_sha256": [hash_key(TENANT_KEY)]}],
        "operator_key_sha256": [hash_key(OPERATOR_KEY)] if operator_keys is None else operator_keys,
    }
    return out


def one_child() -> ChildSet:
    return ChildSet(
        [Child("c0", Endpoint("127.0.0.1", 1), frozenset({"demo-llm"}))],
        probe_interval_s=1,
        summary_ttl_s=60,
        probe=False,
    )


@dataclass
class Ops:
    """The running ops servers: the global's address and the inner tiers'."""

    global_address: str
    inner: dict[str, str]
    topology: Topology


@asynccontextmanager
async def ops_fleet(mapping: dict[str, Any]) -> AsyncIterator[Ops]:
    """A global ops server with its fleet view over a regional and a local one, every
    one of them checking ``mapping``'s ``auth``; all stopped at the end."""
    mapping = copy.deepcopy(mapping)
    access = OpsAccess.of(topology_from_mapping(mapping).auth)
    started: list[OpsServer] = []
    try:
        region = mapping["regions"][0]
        zone = region["zones"][0]
        for kind, entry in (("regional", region), ("local", zone)):
            server = OpsServer(
                Endpoint("127.0.0.1", 0),
                entry["name"],
                TierMetrics(kind, one_child()),
                access=access,
            )
            await server.start()
            started.append(server)
            entry["ops_listen"] = server.address
        topology = topology_from_mapping(mapping)
        own = OpsServer(
            Endpoint("127.0.0.1", 0),
            "global",
            TierMetrics("global", one_child()),
            extensions=(FleetView(topology, timeout_s=5),),
            access=access,
        )
        await own.start()
        started.append(own)
        inner = {"regional": started[0].address, "local": started[1].address}
        yield Ops(own.address, inner, topology)
    finally:
        for server in reversed(started):
            await server.stop()


async def call(
    session: aiohttp.ClientSession, address: str, path: str, authorization: str | None = None
) -> tuple[int, dict[str, str], Any]:
    headers = {} if authorization is None else {"Authorization": authorization}
    async with session.get(f"http://{address}{path}", headers=headers) as reply:
        text = await reply.text()
        is_json = reply.content_type == "application/json"
        return reply.status, dict(reply.headers), yaml.safe_load(text) if is_json else text


async def test_with_auth_on_metrics_probes_and_the_page_need_no_key() -> None:
    async with ops_fleet(spec()) as ops, aiohttp.ClientSession() as session:
        for path in OPEN:
            status, headers, _ = await call(session, ops.global_address, path)
            assert status == 200, path
            assert "WWW-Authenticate" not in headers
        for address in ops.inner.values():
            for path in ("/metrics", "/healthz", "/readyz"):
                assert (await call(session, address, path))[0] == 200, path


async def test_with_auth_on_the_data_needs_the_operator_key() -> None:
    bearer = f"Bearer {OPERATOR_KEY}"
    async with ops_fleet(spec()) as ops, aiohttp.ClientSession() as session:
        targets = [(ops.global_address, p) for p in GLOBAL_DATA]
        targets += [(a, p) for a in ops.inner.values() for p in ("/api/state", "/api/traces")]
        for address, path in targets:
            status, headers, body = await call(session, address, path)
            assert (status, body) == (401, MISSING), path
            assert headers["WWW-Authenticate"] == 'Bearer realm="meridian-ops"'
            status, headers, body = await call(session, address, path, f"Basic {OPERATOR_KEY}")
            assert (status, body) == (401, NOT_BEARER), path
            assert headers["WWW-Authenticate"] == 'Bearer realm="meridian-ops"'
            for wrong in ("Bearer mk-not-a-key", f"Bearer {TENANT_KEY}"):
                status, headers, body = await call(session, address, path, wrong)
                assert (status, body) == (403, REFUSED), (path, wrong)
                assert "WWW-Authenticate" not in headers
            status, _, body = await call(session, address, path, bearer)
            assert status == 200, (path, body)


async def test_the_fleet_view_passes_the_viewers_key_to_the_inner_tiers() -> None:
    async with ops_fleet(spec()) as ops, aiohttp.ClientSession() as session:
        status, _, fleet = await call(
            session, ops.global_address, "/api/fleet", f"Bearer {OPERATOR_KEY}"
        )
        assert status == 200
        (region,) = fleet["regions"]
        assert (region["reachable"], region["error"]) == (True, "")
        (zone,) = region["zones"]
        assert zone["reachable"] is True and zone["error"] == ""


async def test_meridian_top_sends_the_operator_key() -> None:
    # `meridian top` asks with blocking urllib: from a thread of its own, stopped at the end.
    loop = asyncio.get_running_loop()
    async with ops_fleet(spec()) as ops:
        base = f"http://{ops.global_address}"
        with ThreadPoolExecutor(1) as pool:
            text, answered = await loop.run_in_executor(pool, frame, base, Paint(False), 5.0)
            assert not answered and "HTTPError: Unauthorized" in text
            text, answered = await loop.run_in_executor(
                pool, frame, base, Paint(False), 5.0, OPERATOR_KEY
            )
            assert answered, text


async def test_with_auth_off_everything_is_open() -> None:
    async with ops_fleet(spec(enabled=False)) as ops, aiohttp.ClientSession() as session:
        for path in OPEN + GLOBAL_DATA:
            assert (await call(session, ops.global_address, path))[0] == 200, path
        for address in ops.inner.values():
            assert (await call(session, address, "/api/state"))[0] == 200
        fleet = (await call(session, ops.global_address, "/api/fleet"))[2]
        assert fleet["regions"][0]["reachable"] is True


async def test_with_auth_on_and_no_operator_key_the_data_is_closed_to_every_key() -> None:
    async with ops_fleet(spec(operator_keys=[])) as ops, aiohttp.ClientSession() as session:
        for authorization in (f"Bearer {OPERATOR_KEY}", f"Bearer {TENANT_KEY}"):
            status, _, body = await call(session, ops.global_address, "/api/state", authorization)
            assert (status, body) == (403, REFUSED)
        assert (await call(session, ops.global_address, "/metrics"))[0] == 200


def test_the_dashboard_page_asks_for_the_key_and_sends_it_as_a_bearer() -> None:
    page = DASHBOARD_HTML.read_text()
    assert '<form id="key-form" hidden>' in page and 'id="operator-key"' in page
    assert "sessionStorage.setItem(KEY_ITEM" in page
    assert 'Authorization: "Bearer " + key' in page


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            [hash_key("a"), "not-a-digest"],
            "auth.operator_key_sha256[1]: expected a SHA-256 hex digest "
            "(64 hex characters; `meridian keygen` prints one)",
        ),
        ("one", "auth.operator_key_sha256: expected list, got 'one'"),
        ([hash_key(TENANT_KEY)], "auth.operator_key_sha256[0]: is also a tenant's API key"),
    ],
)
def test_a_bad_operator_key_fails_at_start_naming_it(keys: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(spec(operator_keys=keys))
    assert str(err.value) == message


def test_digests_are_read_in_any_case_and_compared_as_lower_case() -> None:
    topology = topology_from_mapping(spec(operator_keys=[hash_key(OPERATOR_KEY).upper()]))
    assert topology.auth.operator_key_hashes == {hash_key(OPERATOR_KEY)}
    assert OpsAccess.of(topology.auth).is_operator(OPERATOR_KEY)
    assert not OpsAccess.of(topology.auth).is_operator(TENANT_KEY)


def test_meridian_up_makes_an_operator_key_when_auth_is_on() -> None:
    raw = yaml.safe_load(DEMO_FLEET.read_text())
    assert raw["auth"]["enabled"] is True
    key = generate_operator_key(raw)
    assert key is not None and raw["auth"]["operator_key_sha256"] == [hash_key(key)]
    assert key not in yaml.safe_dump(raw)
    assert generate_operator_key(raw) is None  # the file has one now
    off = {"auth": {"enabled": False, "tenants": []}}
    assert generate_operator_key(off) is None and "operator_key_sha256" not in off["auth"]


def test_a_cluster_keeps_the_operator_digest_in_the_secret_only() -> None:
    raw = {"auth": {"enabled": True, "operator_key": "generate", "tenants": []}}
    keys = resolve_directives(raw, generate=True)
    assert keys.operator_key is not None
    assert raw["auth"]["operator_key_sha256"] == [hash_key(keys.operator_key)]
    assert "operator_key_sha256" not in public_auth(raw["auth"])
    pending = {"auth": {"enabled": True, "operator_key": "generate", "tenants": []}}
    assert resolve_directives(pending, generate=False).pending == ["the ops HTTP's /api/*"]
