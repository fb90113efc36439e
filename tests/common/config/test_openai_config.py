"""The global tier's OpenAI HTTP settings: ``openai_listen`` and ``openai_timeout_s``."""

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
