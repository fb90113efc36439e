"""worker_topology: what the workers of one tier share (data-plane ports, SO_REUSEPORT)
and what each holds alone (its ops port, the local tier's share of each GPU's slots)."""

from __future__ import annotations

from typing import Any

import pytest

from cli.workers import WorkerPlace, worker_addresses, worker_topology
from common.config.node import ConfigError, Endpoint
from common.config.topology import Topology, topology_from_mapping
from sim.topology import one_zone_mapping


def mapping(**zone: Any) -> dict[str, Any]:
    m = one_zone_mapping(
        "redis://127.0.0.1:1/0", global_listen="127.0.0.1:7001", region_listen="127.0.0.1:7002",
        max_concurrency=5, gpus=2,
    )  # fmt: skip
    m["global"].update(ops_listen="127.0.0.1:7100", openai_listen="127.0.0.1:7200")
    m["regions"][0]["ops_listen"] = "127.0.0.1:7300"
    z = m["regions"][0]["zones"][0]
    z.update({"listen": "127.0.0.1:7003", "ops_listen": "127.0.0.1:7400", **zone})
    return m


def topo(**zone: Any) -> Topology:
    return topology_from_mapping(mapping(**zone))


def test_the_only_worker_binds_the_topology_as_it_is() -> None:
    t = topo()
    assert worker_topology(t, "local", WorkerPlace(), "r", "r-1a") is t


def test_global_workers_share_v2_and_openai_and_each_has_its_ops_port() -> None:
    g = worker_topology(topo(), "global", WorkerPlace(1, 2)).global_tier
    assert g.endpoint == Endpoint("127.0.0.1", 7001) and g.endpoint.reuse_port
    assert g.openai is not None and g.openai.endpoint.reuse_port
    assert g.ops == Endpoint("127.0.0.1", 7101) and not g.ops.reuse_port


def test_regional_workers_share_their_port() -> None:
    r = worker_topology(topo(), "regional", WorkerPlace(1, 3), "r").region("r")
    assert r.endpoint.reuse_port and r.ops == Endpoint("127.0.0.1", 7301)
    z = r.zones[0]
    assert not z.endpoint.reuse_port and z.gpus[0].held_slots is None  # not its to split


def test_local_workers_split_every_gpu_and_share_ext_proc() -> None:
    t = topo(ext_proc={"listen": "127.0.0.1:7500"})
    zones = [
        worker_topology(t, "local", WorkerPlace(i, 2), "r", "r-1a").zone("r", "r-1a")
        for i in range(2)
    ]
    assert [[g.slots for g in z.gpus] for z in zones] == [[3, 3], [2, 2]]
    assert all(z.endpoint.reuse_port and z.ext_proc and z.ext_proc.listen.reuse_port for z in zones)
    assert [z.ops for z in zones] == [Endpoint("127.0.0.1", 7400), Endpoint("127.0.0.1", 7401)]


def test_ops_port_0_stays_0_each_worker_picks_its_own() -> None:
    t = topo(ops_listen="127.0.0.1:0")
    z = worker_topology(t, "local", WorkerPlace(1, 2), "r", "r-1a").zone("r", "r-1a")
    assert z.ops == Endpoint("127.0.0.1", 0)


@pytest.mark.parametrize(
    ("command", "change", "key"),
    [
        ("global", lambda m: m["global"].update(listen="127.0.0.1:0"), "global.listen"),
        ("global", lambda m: m["global"].update(openai_listen="127.0.0.1:0"),
         "global.openai.listen"),
        ("regional", lambda m: m["regions"][0].update(listen="127.0.0.1:0"), "regions[0].listen"),
        ("local", lambda m: m["regions"][0]["zones"][0].update(listen="127.0.0.1:0"),
         "regions[0].zones[0].listen"),
        ("regional", lambda m: m["regions"][0].update(openai_listen="127.0.0.1:0"),
         "regions[0].openai_listen"),
        ("local", lambda m: m["regions"][0]["zones"][0].update(openai_listen="127.0.0.1:0"),
         "regions[0].zones[0].openai_listen"),
    ],
)  # fmt: skip
def test_a_shared_port_must_be_fixed(command: str, change: Any, key: str) -> None:
    m = mapping()
    change(m)
    with pytest.raises(ConfigError) as err:
        worker_topology(topology_from_mapping(m), command, WorkerPlace(0, 2), "r", "r-1a")
    assert str(err.value).startswith(f"{key}: port 0 picks a port per process")


def test_the_supervisor_checks_every_shared_port_and_each_workers_ops() -> None:
    got = worker_addresses(topo(ext_proc={"listen": "127.0.0.1:7500"}), "local", 2, "r", "r-1a")
    assert [e.address for e in got] == [
        "127.0.0.1:7003", "127.0.0.1:7500", "127.0.0.1:7400", "127.0.0.1:7401"
    ]  # fmt: skip


def test_an_inner_tiers_openai_edge_is_shared_and_checked_free() -> None:
    m = mapping(openai_listen="127.0.0.1:7600")
    m["regions"][0]["openai_listen"] = "127.0.0.1:7700"
    t = topology_from_mapping(m)
    z = worker_topology(t, "local", WorkerPlace(1, 2), "r", "r-1a").zone("r", "r-1a")
    r = worker_topology(t, "regional", WorkerPlace(1, 2), "r").region("r")
    assert z.openai is not None and z.openai.endpoint.reuse_port
    assert r.openai is not None and r.openai.endpoint.reuse_port
    local = [e.address for e in worker_addresses(t, "local", 2, "r", "r-1a")]
    regional = [e.address for e in worker_addresses(t, "regional", 2, "r")]
    assert "127.0.0.1:7600" in local and "127.0.0.1:7700" in regional


def test_every_workers_slot_split_is_checked_before_any_starts() -> None:
    with pytest.raises(ConfigError, match=r"gpus\[0\].max_concurrency: 5 slots cannot be split"):
        worker_addresses(topo(), "local", 6, "r", "r-1a")


@pytest.mark.parametrize(
    ("index", "count", "flag"), [(0, 0, "--workers"), (2, 2, "--worker-index")]
)
def test_a_bad_place_names_its_flag(index: int, count: int, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        WorkerPlace(index, count)
