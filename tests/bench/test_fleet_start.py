"""bench.fleet_start's fleets are valid topologies of the shapes it says, and a child it
launches finds its bytecode where the bench put it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.fleet_start import SHAPES, code_from, compile_into, fleet_file
from cli.launcher import generate_admin_key, generate_tenant_keys, resolve_ports
from common.config.topology import topology_from_mapping


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_is_a_topology_of_its_regions_and_gpus(shape: str, tmp_path: Path) -> None:
    regions, gpus = SHAPES[shape]
    raw = yaml.safe_load(fleet_file(tmp_path, regions, gpus).read_text())
    generate_tenant_keys(raw)  # as the launcher does: the file says `api_key: generate`
    generate_admin_key(raw)
    topology = topology_from_mapping(resolve_ports(raw))
    assert len(topology.regions) == regions
    assert [len(r.zones) for r in topology.regions] == [1] * regions
    assert [len(r.zones[0].gpus) for r in topology.regions] == [gpus] * regions


def test_a_child_reads_the_bytecode_of_the_cache_and_writes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "probe_module.py"
    source.write_text("VALUE = 1\n")
    (tmp_path / "uncached_module.py").write_text("VALUE = 3\n")
    cache = tmp_path / "cache"
    compile_into(cache, [source])
    assert len(list(cache.rglob("*.pyc"))) == 1
    # Writing is allowed out here, so only code_from can be what keeps the child from it.
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    stat = source.stat()
    with code_from(cache):
        # The source now says 2 in as many bytes and with its old mtime: Python checks a
        # .pyc against those, so it runs the cached bytecode (1) if it found it, else 2.
        source.write_text("VALUE = 2\n")
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        code = "import probe_module, uncached_module; print(probe_module.VALUE)"
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    assert "PYTHONPYCACHEPREFIX" not in os.environ  # put back as it was
    assert out.strip() == "1"
    # The module it compiled from source left no bytecode, in the cache or beside it.
    assert len(list(tmp_path.rglob("*.pyc"))) == 1
