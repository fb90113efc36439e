"""``meridian sim``: ``--sized-to-demand`` shapes a generated fleet (and only one), and a
run writes each scenario's regional load to fleet.json and fleet.md."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.sim import sim_main
from sim.fleet_gen import fleet_mapping


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    return sim_main(argv, out), out.getvalue()


def per_region(mapping: dict[str, Any]) -> list[int]:
    return [sum(len(z["gpus"]) for z in r["zones"]) for r in mapping["regions"]]


def test_fleet_sized_to_demand_writes_the_demand_split(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    code, _ = run(
        ["fleet", "--gpus", "96", "--regions", "6", "--sized-to-demand", "--out", str(path)]
    )
    assert code == 0
    written = per_region(yaml.safe_load(path.read_text()))
    expected = fleet_mapping(gpus=96, regions=6, seed=1, sized_to_demand=True)
    assert written == per_region(expected) != per_region(fleet_mapping(gpus=96, regions=6, seed=1))


def test_sized_to_demand_refuses_a_given_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.yaml"
    assert run(["fleet", "--gpus", "8", "--regions", "2", "--out", str(path)])[0] == 0
    code, _ = run(["run", "--fleet", str(path), "--sized-to-demand", "--out", str(tmp_path)])
    assert code == 2 and "--sized-to-demand" in capsys.readouterr().err


def test_a_run_reports_each_regions_load(tmp_path: Path) -> None:
    argv = ["run", "--quick", "--requests", "300", "--scenarios", "day-90,steady-90"]
    argv += ["--policies", "meridian", "--jobs", "1", "--no-plots", "--sized-to-demand"]
    code, text = run([*argv, "--out", str(tmp_path)])
    assert code == 0, text
    results = json.loads((tmp_path / "fleet.json").read_text())
    for scenario in results["scenarios"]:
        load = scenario["regional_load"]
        assert set(load["series"]) == set(results["meta"]["regions"])
        assert abs(load["fleet_mean"] - scenario["load"]) < 1e-9
    markdown = (tmp_path / "fleet.md").read_text()
    assert markdown.count("**Offered load ÷ capacity by region**") == 2
