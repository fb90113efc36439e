"""A GPU's ``protocol`` key: v2 by default, openai with its metrics on the API port."""

from __future__ import annotations

from typing import Any

import pytest

from common.config.node import ConfigError
from common.config.topology import topology_from_mapping
from sim.topology import one_zone_mapping


def gpu_entry(raw: dict[str, Any], i: int = 0) -> dict[str, Any]:
    entry: dict[str, Any] = raw["regions"][0]["zones"][0]["gpus"][i]
    return entry


def mapping() -> dict[str, Any]:
    return one_zone_mapping("redis://127.0.0.1:1/0", gpus=2)


def test_protocol_defaults_to_v2() -> None:
    gpus = topology_from_mapping(mapping()).zone("r", "r-1a").gpus
    assert [g.protocol for g in gpus] == ["v2", "v2"]


def test_an_openai_gpu_serves_its_metrics_on_its_api_port_unless_told() -> None:
    raw = mapping()
    gpu_entry(raw, 0).update(protocol="openai")
    del gpu_entry(raw, 0)["metrics_listen"]
    gpu_entry(raw, 1).update(protocol="openai", metrics_listen="127.0.0.1:9400")
    g0, g1 = topology_from_mapping(raw).zone("r", "r-1a").gpus
    assert g0.protocol == "openai" and g0.metrics_endpoint == g0.endpoint
    assert g1.metrics_endpoint.port == 9400


@pytest.mark.parametrize(
    ("value", "says"),
    [("grpc", "unknown protocol 'grpc'"), (2, "expected str")],
)
def test_a_bad_protocol_names_its_key(value: object, says: str) -> None:
    raw = mapping()
    gpu_entry(raw, 1).update(protocol=value)
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(raw)
    assert str(err.value).startswith("regions[0].zones[0].gpus[1].protocol: ")
    assert says in str(err.value)


def test_tls_towards_an_openai_gpu_is_refused_naming_the_key() -> None:
    raw = mapping()
    gpu_entry(raw, 0).update(protocol="openai", tls=True)
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(raw)
    assert str(err.value).startswith("regions[0].zones[0].gpus[0].tls: ")
