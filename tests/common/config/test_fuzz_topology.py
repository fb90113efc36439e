"""Fuzzing the topology loader (``common.config.topology``) in process: a small valid
fleet with values replaced, keys dropped or misspelt, and YAML text of any shape.

Properties: only ``ConfigError`` comes out, and its message starts with the key path
to fix (``regions[1].zones[0].gpus[0].hardware: …``) or, for the file as a whole,
the file's name; a misspelt key is named exactly; an accepted topology has
finite, positive cadences. Deterministic and bounded.
"""

from __future__ import annotations

import copy
import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cli.launcher import DEMO_FLEET
from common.config.node import ConfigError
from common.config.topology import Topology, load_topology, topology_from_mapping

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
DIGEST = "ab" * 32


def small_fleet() -> dict[str, Any]:
    """Two regions of one zone of two GPUs, from the demo file; fixed key digests."""
    raw: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    raw["regions"] = raw["regions"][:2]
    for region in raw["regions"]:
        region["zones"] = region["zones"][:1]
        region["zones"][0]["gpus"] = region["zones"][0]["gpus"][:2]
    auth = raw["auth"]
    del auth["admin_key"]
    auth["admin_keys"] = [DIGEST]
    for tenant in auth["tenants"]:
        del tenant["api_key"]
        tenant["api_key_sha256"] = [DIGEST.replace("a", "c", len(tenant["id"]))]
    names = [r["name"] for r in raw["regions"]]
    raw["rtt_ms"] = {names[0]: {names[1]: 80}}
    raw["limits"] = {"max_prompt_bytes": 65536, "stream_idle_timeout_s": 60.0}
    return raw


BASE = small_fleet()


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from paths(value, (*prefix, i))


PATHS = [p for p in paths(BASE) if p]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.sampled_from([0, -1, 10**400, 65536, 65535]),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(["127.0.0.1:0", "[::1]:8001", "host:99999", ":80", "H100", "demo-llm"]),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def key_path(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def apply(raw: dict[str, Any], path: tuple[Any, ...], op: str, value: Any) -> None:
    parent = raw
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "replace":
        parent[last] = value
    elif isinstance(parent[last], dict):  # "misspell": a key nobody reads
        parent[last]["zz_typo"] = value
        if op == "typos":  # and one that is no string at all
            parent[last][None] = value


def named_path(message: str) -> bool:
    """The message opens with a key path (``a.b[2].c:``) or ``<root>:``."""
    return re.match(r"(<root>|[A-Za-z_][\w-]*(\[\d+\])*(\.[^\s:]+)*): ", message) is not None


def accepted(topology: Topology) -> None:
    for value in (topology.summary_cadence_s, topology.health_interval_s, topology.time_scale):
        assert math.isfinite(value) and value > 0, value
    assert math.isfinite(topology.slow_start_window_s) and topology.slow_start_window_s >= 0
    assert math.isfinite(topology.failback_window_s) and topology.failback_window_s >= 0
    for region in topology.regions:
        assert -90 <= region.location.lat <= 90 and -180 <= region.location.lon <= 180


EDITS = st.lists(
    st.tuples(
        st.sampled_from(PATHS), st.sampled_from(["replace", "delete", "misspell", "typos"]), VALUES
    ),
    min_size=1,
    max_size=3,
)


@FUZZ
@given(edits=EDITS)
@example(edits=[(("summary_cadence_s",), "replace", math.nan)])  # found: NaN accepted
@example(edits=[(("regions", 0, "zones", 0, "gpus", 0, "throttle"), "replace", math.nan)])
@example(edits=[(("global", "location", "lat"), "replace", 10**400)])  # found: OverflowError
@example(edits=[(("rtt_ms", "us-east", "eu-west"), "replace", 10**400)])
@example(edits=[(("auth", "tenants", 0, "requests_per_s"), "replace", 10**400)])
@example(edits=[(("rtt_ms", "us-east"), "misspell", 1)])
@example(edits=[(("auth", "tenants", 1), "misspell", None)])
@example(edits=[(("global",), "typos", 1)])  # found: TypeError sorting None and "zz_typo"
@example(edits=[(("global",), "misspell", 1), (("global", "listen"), "replace", "x:1")])
@example(edits=[(("auth", "tenants", 1, "allowed_regions", 0), "replace", [])])  # found: TypeError
def test_edited_topologies_load_or_name_the_key(edits: list[tuple[Any, str, Any]]) -> None:
    raw = copy.deepcopy(BASE)
    for path, op, value in edits:
        try:
            apply(raw, path, op, value)
        except (KeyError, IndexError, TypeError):
            return  # an earlier edit removed or replaced what this one would edit
    try:
        topology = topology_from_mapping(raw)
    except ConfigError as err:
        assert named_path(str(err)), str(err)
        if len(edits) == 1 and edits[0][1] == "misspell":
            assert str(err).startswith(f"{key_path(edits[0][0])}.zz_typo: "), str(err)
        return
    accepted(topology)


YAML_TEXT = st.one_of(
    st.text(max_size=40),
    st.text("{}[]:,-'\"&*!|> \n\tab1.", max_size=40),
    st.sampled_from(["", "~", "[]", "a: b", "global: []", "!!python/object:os.system ls", "\xff"]),
)


@FUZZ
@given(text=YAML_TEXT)
@example(text="a: 1" + "0" * 5000)  # found: ValueError, an int over int()'s 4300 digits
@example(text="{? [a]: 1}")
@example(text="a: &x [*x]")
@example(text="global: {listen: 127.0.0.1:0, location: {lat: 1" + "0" * 400 + ", lon: 0}}")
@example(text="regions: !!binary aGVsbG8=")
@example(text="\ufeffglobal: 1")
def test_any_yaml_loads_or_names_the_key_or_file(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fleet.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            accepted(load_topology(path))
        except ConfigError as err:
            message = str(err)
            assert message.startswith(str(path)) or named_path(message), message
