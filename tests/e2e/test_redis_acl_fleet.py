"""A fleet under ``meridian up``'s launcher runs with a Redis ACL user per role
(``cli.redis_acl.FleetAcl``; every fleet of the e2e suite does): each tier is
connected as its own user, a request with quotas and a usage record goes through,
``meridian usage`` reads it as the read-only user, and a tier's password cannot
write another zone's summary or a quota."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.exceptions import NoPermissionError

from cli.launcher import Fleet
from cli.usage import usage_main
from common.basics.redis_url import sync_redis, with_credentials
from common.capacity.streams import zone_stream
from common.operations.redis_acl import ADMIN, USAGE
from tests.client import V2Client
from tests.conftest import small_fleet_spec
from tests.until import wait_until


def acl_fleet_spec() -> dict[str, Any]:
    spec = small_fleet_spec(regions=2, zones=1, gpus=1)
    spec["auth"] = {
        "enabled": True,
        "tenants": [
            {"id": "gold", "api_key": "generate", "requests_per_s": 50, "max_concurrent": 4},
        ],
    }
    return spec


def login(fleet: Fleet, user: str) -> redis.Redis:
    assert fleet.acl is not None and fleet.redis is not None
    password = fleet.acl.password_file(user).read_text().strip()
    url = with_credentials(fleet.redis.address_url, user, password)
    return sync_redis(url, socket_timeout=5)  # as Meridian connects


def denials(admin: redis.Redis) -> list[tuple[str, str, str]]:
    """ACL LOG: who was refused what, but for the CLIENT MAINT_NOTIFICATIONS redis-py
    tries on each new connection (no role may run CLIENT; redis-py goes on without)."""
    log = [(e["username"], e["reason"], e["object"]) for e in admin.acl_log()]
    return [entry for entry in log if entry[1:] != ("command", "client")]


def test_a_fleet_runs_with_a_redis_user_per_role(
    fleet_factory: Callable[..., Fleet], capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = fleet_factory(acl_fleet_spec())
    (eu, eu_zone), (us, us_zone) = [(r.name, r.zones[0].name) for r in fleet.topology.regions]
    tiers = {
        "meridian/global",
        f"meridian/regional/{eu}",
        f"meridian/regional/{us}",
        f"meridian/local/{eu}/{eu_zone}",
        f"meridian/local/{us}/{us_zone}",
    }
    with V2Client(fleet.global_address) as client:
        reply = client.infer(metadata=[("authorization", f"Bearer {fleet.tenant_keys['gold']}")])
    assert reply.route
    admin, local_eu = login(fleet, ADMIN), login(fleet, f"meridian/local/{eu}/{eu_zone}")
    try:

        def connected() -> set[str]:
            return {c["user"] for c in admin.client_list()} - {ADMIN}

        wait_until(lambda: connected() == tiers, what=f"{tiers} connected, nobody else")
        # The request's quota scripts ran in Redis, and no tier was refused anything.
        assert admin.info("commandstats")["cmdstat_evalsha"]["calls"] > 0
        assert denials(admin) == []
        with pytest.raises(NoPermissionError):
            local_eu.xadd(zone_stream(us, us_zone), {"summary": "forged"})
        with pytest.raises(NoPermissionError):
            local_eu.set("meridian:quota:{gold}:rps", 0)
        assert sorted(denials(admin)) == sorted([
            (f"meridian/local/{eu}/{eu_zone}", "key", zone_stream(us, us_zone)),
            (f"meridian/local/{eu}/{eu_zone}", "command", "set"),
        ])  # fmt: skip
    finally:
        admin.close()
        local_eu.close()
    password_file = str(fleet.acl.password_file(USAGE)) if fleet.acl else ""
    argv = ["--redis", fleet.topology.redis_url, "--redis-password-file", password_file]

    def counted() -> bool:
        capsys.readouterr()
        return usage_main([*argv, "--json"]) == 0 and '"tenant": "gold"' in capsys.readouterr().out

    wait_until(counted, what="the request's usage record, read as meridian/usage")
