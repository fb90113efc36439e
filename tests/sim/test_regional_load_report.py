"""The regional load in the results: its Markdown table, its place in fleet.md, and the
JSON round trip (results written before it existed read back as None)."""

from __future__ import annotations

import json
import math

import pytest

from sim.regional_load import RegionalLoad, load_table
from sim.results import RunResults, ScenarioResult
from sim.tables import render_markdown


@pytest.fixture
def load() -> RegionalLoad:
    return RegionalLoad(
        duration_s=240.0,
        gpus={"us-east": 6, "ap-southeast": 2},
        capacity_rps={"us-east": 30.0, "ap-southeast": 10.0},
        series={"us-east": [0.5, 0.7, 0.9, 0.7], "ap-southeast": [1.6, 1.0, 0.4, 1.0]},
        peak={"us-east": 0.9, "ap-southeast": 1.6},
        peak_at_s={"us-east": 120.0, "ap-southeast": 0.0},
        fleet_mean=0.9,
    )


def result(load: RegionalLoad | None) -> RunResults:
    return RunResults(
        meta={"seed": 1},
        scenarios=[ScenarioResult("day-90", "a day", 0.9, [], {}, regional_load=load)],
    )


def rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]


def test_the_table_has_a_row_per_region_and_the_fleet(load: RegionalLoad) -> None:
    cells = rows(load_table(load, columns=2))
    assert cells[0] == ["region", "GPUs", "capacity", "mean", "peak", "peak at", "0 s", "120 s"]
    assert cells[2] == ["us-east", "6", "30 rps", "0.70", "0.90", "120 s", "0.60", "0.80"]
    # Above 1 is more than the region can serve: bold.
    assert cells[3][3:] == ["1.00", "**1.60**", "0 s", "**1.30**", "0.70"]
    assert cells[4][:4] == ["fleet", "8", "40 rps", "0.90"]
    assert all(len(row) == len(cells[0]) for row in cells if row[0] != "---")


def test_a_short_run_shows_tenths_of_a_second(load: RegionalLoad) -> None:
    load.duration_s = 12.0
    assert rows(load_table(load, columns=4))[0][6:] == ["0.0 s", "3.0 s", "6.0 s", "9.0 s"]


def test_fleet_md_shows_it_under_its_scenario(load: RegionalLoad) -> None:
    markdown = render_markdown(result(load), [])
    section = markdown[markdown.index("## day-90") :]
    assert "**Offered load ÷ capacity by region**" in section
    assert "| ap-southeast | 2 | 10 rps |" in section
    assert "Offered load ÷ capacity" not in render_markdown(result(None), [])


def test_json_round_trips(load: RegionalLoad) -> None:
    run = result(load)
    back = RunResults.from_json(json.loads(json.dumps(run.to_json())))
    assert back == run
    assert back.scenarios[0].regional_load == load


def test_a_region_without_capacity_round_trips_as_plain_json(load: RegionalLoad) -> None:
    load.capacity_rps["ap-southeast"] = 0.0
    load.series["ap-southeast"] = [math.inf] * 4
    load.peak["ap-southeast"] = math.inf
    text = json.dumps(result(load).to_json(), allow_nan=False)
    assert RunResults.from_json(json.loads(text)).scenarios[0].regional_load == load


def test_results_without_it_read_back_as_none(load: RegionalLoad) -> None:
    data = result(load).to_json()
    del data["scenarios"][0]["regional_load"]
    assert RunResults.from_json(data).scenarios[0].regional_load is None
    empty = result(None)
    assert RunResults.from_json(json.loads(json.dumps(empty.to_json()))) == empty
