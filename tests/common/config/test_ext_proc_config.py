"""A zone's ext_proc section: defaults, and each bad value named by its key path."""

from typing import Any

import pytest

from common.config.ext_proc import DEFAULT_FALLBACKS, DEFAULT_MAX_WAIT_S
from common.config.node import ConfigError, Endpoint
from common.config.topology import topology_from_mapping
from sim.topology import one_zone_mapping


def _topology(ext_proc: Any) -> Any:
    mapping = one_zone_mapping("redis://127.0.0.1:1/0")
    if ext_proc is not None:
        mapping["regions"][0]["zones"][0]["ext_proc"] = ext_proc
    return topology_from_mapping(mapping).zone("r", "r-1a").ext_proc


def test_absent_means_off() -> None:
    assert _topology(None) is None


def test_defaults() -> None:
    config = _topology({"listen": "127.0.0.1:9002"})
    assert config.listen == Endpoint("127.0.0.1", 9002)
    assert (config.fallbacks, config.max_wait_s) == (DEFAULT_FALLBACKS, DEFAULT_MAX_WAIT_S)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "regions[0].zones[0].ext_proc.listen: required key is missing"),
        ({"listen": "nowhere"}, "regions[0].zones[0].ext_proc.listen: expected 'host:port'"),
        ({"listen": "127.0.0.1:1", "fallbacks": 9}, "ext_proc.fallbacks: must be between 0 and 8"),
        ({"listen": "127.0.0.1:1", "max_wait_s": 0}, "ext_proc.max_wait_s: must be > 0"),
        ({"listen": "127.0.0.1:1", "fallback": 1}, "ext_proc.fallback: unknown key"),
        ("127.0.0.1:1", "regions[0].zones[0].ext_proc: expected a mapping"),
    ],
)
def test_bad_values_name_their_key(section: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _topology(section)
