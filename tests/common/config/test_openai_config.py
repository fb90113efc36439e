"""The OpenAI HTTP settings, ``openai_listen`` and ``openai_timeout_s``: in ``global``, a
region's entry or a zone's."""

from typing import Any

import pytest

from cli.launcher import resolve_ports
from common.config.node import ConfigError, Endpoint
from common.config.openai_edge import DEFAULT_OPENAI_TIMEOUT_S
from common.config.topology import topology_from_mapping
from tests.common.config.test_config import demo


def with_global(**keys: Any) -> dict[str, Any]:
    raw = demo()
    raw["global"].pop("openai_listen", None)
    raw["global"].update(keys)
    return raw


def test_the_demo_fleet_serves_openai_on_8000() -> None:
    openai = topology_from_mapping(demo()).global_tier.openai
    assert openai is not None
    assert (openai.endpoint, openai.timeout_s) == (
        Endpoint("127.0.0.1", 8000),
        DEFAULT_OPENAI_TIMEOUT_S,
    )


def test_a_bare_global_serves_no_openai() -> None:
    assert topology_from_mapping(with_global()).global_tier.openai is None


def test_the_timeout_is_read() -> None:
    raw = with_global(openai_listen="[::1]:0", openai_timeout_s=30)
    openai = topology_from_mapping(raw).global_tier.openai
    assert openai is not None and openai.timeout_s == 30.0 and openai.endpoint.host == "::1"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"openai_listen": "8000"}, r"^global\.openai_listen: expected 'host:port'"),
        ({"openai_listen": 8000}, r"^global\.openai_listen: expected 'host:port'"),
        (
            {"openai_listen": "127.0.0.1:0", "openai_timeout_s": 0},
            r"^global\.openai_timeout_s: must be > 0",
        ),
        (
            {"openai_listen": "127.0.0.1:0", "openai_timeout_s": "10s"},
            r"^global\.openai_timeout_s: expected float",
        ),
        ({"openai_timeout_s": 10}, r"^global\.openai_timeout_s: set without openai_listen"),
        ({"openai_listne": "127.0.0.1:0"}, r"^global\.openai_listne: unknown key"),
    ],
)
def test_a_bad_setting_names_its_key(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        topology_from_mapping(with_global(**keys))


def test_the_launcher_resolves_port_0() -> None:
    raw = resolve_ports(with_global(openai_listen="127.0.0.1:0"))
    port = int(raw["global"]["openai_listen"].rpartition(":")[2])
    assert port > 0


# A zone's and a region's entry take the same keys, with the same meaning and checks.
def _inner(where: str, **keys: Any) -> dict[str, Any]:
    raw = with_global()
    entry = raw["regions"][0] if where == "region" else raw["regions"][0]["zones"][1]
    entry.update(keys)
    return raw


INNER_PATHS = {"region": r"regions\[0\]", "zone": r"regions\[0\]\.zones\[1\]"}


@pytest.mark.parametrize("where", sorted(INNER_PATHS))
def test_a_zone_or_region_reads_the_same_keys(where: str) -> None:
    topo = topology_from_mapping(_inner(where, openai_listen="127.0.0.1:0", openai_timeout_s=5))
    region = topo.regions[0]
    openai = region.openai if where == "region" else region.zones[1].openai
    assert openai is not None and (openai.endpoint.port, openai.timeout_s) == (0, 5.0)
    assert openai.endpoint in list(topo.endpoints())
    others = [z.openai for z in region.zones] + [r.openai for r in topo.regions]
    assert sum(o is not None for o in others) == 1  # only where it was set


@pytest.mark.parametrize("where", sorted(INNER_PATHS))
@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"openai_listen": "8000"}, r"\.openai_listen: expected 'host:port'"),
        ({"openai_listen": "127.0.0.1:0", "openai_timeout_s": 0}, r"\.openai_timeout_s: must be"),
        ({"openai_timeout_s": 10}, r"\.openai_timeout_s: set without openai_listen"),
    ],
)
def test_a_bad_inner_setting_names_its_key(where: str, keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + INNER_PATHS[where] + message):
        topology_from_mapping(_inner(where, **keys))


def test_the_launcher_resolves_an_inner_port_0() -> None:
    raw = resolve_ports(_inner("zone", openai_listen="127.0.0.1:0"))
    port = int(raw["regions"][0]["zones"][1]["openai_listen"].rpartition(":")[2])
    assert port > 0
