import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.launcher import DEMO_FLEET, generate_admin_key, generate_tenant_keys
from common.config.node import ConfigError
from common.config.topology import DEFAULT_TENANT_HEADROOM, load_topology, topology_from_mapping
from common.tenancy.auth import hash_key


def demo() -> dict[str, Any]:
    """The demo fleet file as the launcher hands it over (tenant keys generated)."""
    raw: dict[str, Any] = copy.deepcopy(yaml.safe_load(DEMO_FLEET.read_text()))
    generate_tenant_keys(raw)
    generate_admin_key(raw)
    return raw


def test_demo_fleet_loads() -> None:
    topo = topology_from_mapping(demo())
    assert [r.name for r in topo.regions] == ["us-east", "eu-west", "ap-southeast"]
    assert all(len(r.zones) == 2 for r in topo.regions)
    assert all(len(z.gpus) == 4 for r in topo.regions for z in r.zones)
    assert topo.models == {"demo-llm"}
    assert topo.global_tier.endpoint.address == "127.0.0.1:8001"
    assert topo.summary_ttl_s == pytest.approx(3 * topo.summary_cadence_s)
    assert topo.auth.enabled
    free = topo.auth.tenant("free-tier")
    assert free is not None and free.requests_per_s == 3
    assert free.allowed_regions == {"us-east", "eu-west"}


def test_launcher_keys_are_stored_only_as_hashes() -> None:
    raw = copy.deepcopy(yaml.safe_load(DEMO_FLEET.read_text()))
    admin = generate_admin_key(raw)
    assert admin is not None and hash_key(admin) in raw["auth"]["admin_keys"]
    keys = generate_tenant_keys(raw)
    assert set(keys) == {"demo", "free-tier"}
    text = yaml.safe_dump(raw)
    assert all(key not in text for key in keys.values())
    assert hash_key(keys["demo"]) in text


def test_plain_api_key_in_topology_is_refused() -> None:
    raw = demo()
    raw["auth"]["tenants"][0]["api_key"] = "secret"
    with pytest.raises(ConfigError, match=r"^auth\.tenants\[0\]\.api_key: unknown key"):
        topology_from_mapping(raw)


@pytest.mark.parametrize(
    ("mutate", "key_path"),
    [
        (lambda t: t.update(priority_ceiling="vip"), "auth.tenants[0].priority_ceiling"),
        (lambda t: t.update(allowed_regions=["mars"]), "auth.tenants[0].allowed_regions"),
        (lambda t: t.update(requests_per_s=0), "auth.tenants[0].requests_per_s"),
        (lambda t: t.update(api_key_sha256=["abc"]), "auth.tenants[0].api_key_sha256[0]"),
    ],
)
def test_bad_tenant_value_names_its_key(mutate: Any, key_path: str) -> None:
    raw = demo()
    mutate(raw["auth"]["tenants"][0])
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(raw)
    assert str(err.value).startswith(key_path)


def test_gpu_speed_is_hardware_times_throttle() -> None:
    raw = demo()
    raw["regions"][0]["zones"][0]["gpus"][0].update(hardware="H100", throttle=0.8)
    gpu = topology_from_mapping(raw).regions[0].zones[0].gpus[0]
    assert gpu.speed == pytest.approx(1.6)


def test_an_emulated_gpu_reports_its_tokens_unless_told_not_to() -> None:
    raw = demo()
    raw["regions"][0]["zones"][0]["gpus"][0].update(report_tokens=False)
    gpus = topology_from_mapping(raw).regions[0].zones[0].gpus
    assert [g.report_tokens for g in gpus[:2]] == [False, True]


def test_zone_location_defaults_to_region() -> None:
    raw = demo()
    del raw["regions"][1]["zones"][0]["location"]
    topo = topology_from_mapping(raw)
    assert topo.regions[1].zones[0].location == topo.regions[1].location


@pytest.mark.parametrize(
    ("mutate", "key_path"),
    [
        (
            lambda r: r["regions"][1]["zones"][0]["gpus"][2].update(hardware="TPU"),
            "regions[1].zones[0].gpus[2].hardware",
        ),
        (lambda r: r["regions"][0].update(colour="blue"), "regions[0].colour"),
        (lambda r: r["global"].pop("listen"), "global.listen"),
        (
            lambda r: r["regions"][2]["zones"][1].update(listen="nowhere"),
            "regions[2].zones[1].listen",
        ),
        (lambda r: r["regions"][0]["location"].update(lat=123.0), "regions[0].location"),
        (lambda r: r.update(summary_cadence_s=0), "summary_cadence_s"),
        (
            lambda r: r["regions"][0]["zones"][0]["gpus"][0].update(throttle=1.5),
            "regions[0].zones[0].gpus[0].throttle",
        ),
        (
            lambda r: r["regions"][0]["zones"][0]["gpus"][0].update(models=[]),
            "regions[0].zones[0].gpus[0].models",
        ),
        (
            lambda r: r["regions"][0]["zones"][0]["gpus"][0].update(max_concurrency="many"),
            "regions[0].zones[0].gpus[0].max_concurrency",
        ),
        (
            lambda r: r["regions"][0]["zones"][0]["gpus"][0].update(report_tokens="no"),
            "regions[0].zones[0].gpus[0].report_tokens",
        ),
        (lambda r: r.update(regions=[]), "regions"),
    ],
)
def test_bad_value_names_its_key(mutate: Any, key_path: str) -> None:
    raw = demo()
    mutate(raw)
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(raw)
    assert str(err.value).startswith(key_path)


def test_duplicate_zone_names_rejected() -> None:
    raw = demo()
    zones = raw["regions"][0]["zones"]
    zones[1]["name"] = zones[0]["name"]
    with pytest.raises(ConfigError, match=r"regions\[0\]\.zones: duplicate"):
        topology_from_mapping(raw)


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("regions: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_topology(path)


def test_non_utf8_topology_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"regions: []\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not UTF-8 text \(byte 0xe9 at offset 17\)$"):
        load_topology(path)


def test_usage_replicas_ack_default_and_bounds() -> None:
    assert topology_from_mapping(demo()).usage_replicas_ack == 0
    raw = demo()
    raw["usage_replicas_ack"] = 2
    assert topology_from_mapping(raw).usage_replicas_ack == 2
    for bad, message in ((-1, "must be >= 0, got -1"), ("1", "expected int, got '1'")):
        raw["usage_replicas_ack"] = bad
        with pytest.raises(ConfigError, match=rf"^usage_replicas_ack: {message}"):
            topology_from_mapping(raw)


def test_global_replicas_default_and_bounds() -> None:
    assert topology_from_mapping(demo()).global_tier.replicas == 1
    raw = demo()
    raw["global"]["replicas"] = 3
    assert topology_from_mapping(raw).global_tier.replicas == 3
    for bad, message in ((0, "must be >= 1, got 0"), (1.5, "expected int, got 1.5")):
        raw["global"]["replicas"] = bad
        with pytest.raises(ConfigError, match=rf"^global\.replicas: {message}"):
            topology_from_mapping(raw)


def test_rtt_matrix_and_failback_window() -> None:
    raw = demo()
    raw["rtt_ms"] = {"eu-west": {"us-east": 70, "ap-southeast": 160.5}}
    raw["failback_window_s"] = 4
    topo = topology_from_mapping(raw)
    assert topo.rtt_ms == {"eu-west": {"us-east": 70.0, "ap-southeast": 160.5}}
    assert topo.failback_window_s == 4.0


def test_tenant_headroom_default_and_bounds() -> None:
    assert topology_from_mapping(demo()).tenant_headroom == DEFAULT_TENANT_HEADROOM
    raw = demo()
    raw["tenant_headroom"] = 0
    assert topology_from_mapping(raw).tenant_headroom == 0.0
    raw["tenant_headroom"] = 0.95
    with pytest.raises(ConfigError, match=r"^tenant_headroom: must be between 0 and 0.9"):
        topology_from_mapping(raw)


def test_rtt_matrix_unknown_region_names_its_key() -> None:
    raw = demo()
    raw["rtt_ms"] = {"eu-west": {"mars": 1}}
    with pytest.raises(ConfigError, match=r"^rtt_ms\.eu-west\.mars: unknown region"):
        topology_from_mapping(raw)


def test_admin_keys_are_sha256_digests() -> None:
    raw = demo()
    raw["auth"]["admin_keys"] = ["not-a-digest"]
    with pytest.raises(ConfigError, match=r"auth\.admin_keys\[0\]: expected a SHA-256"):
        topology_from_mapping(raw)


def test_region_zone_and_gpu_names_are_unique_together() -> None:
    raw = demo()
    raw["regions"][1]["zones"][0]["gpus"][0]["name"] = raw["regions"][0]["name"]
    with pytest.raises(ConfigError, match="region, zone and GPU names together"):
        topology_from_mapping(raw)
