"""``meridian sim``: every scenario in its quick form, a trace replay, and bad input.

The runs go through ``sim_main`` in this process (``--jobs 1``), so a failure
shows its traceback; each is small (the ``--quick`` fleet, a few hundred
requests) and writes its results to a temporary directory.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import yaml

from cli.sim import sim_log_level, sim_main
from common.config.topology import topology_from_mapping
from sim.scenarios import SCENARIOS


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    code = sim_main(argv, out)
    return code, out.getvalue()


def test_fleet_writes_a_topology_the_servers_read(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    code, text = run(["fleet", "--gpus", "64", "--regions", "3", "--out", str(path)])
    assert code == 0 and "64 GPUs in 3 regions" in text
    topology = topology_from_mapping(yaml.safe_load(path.read_text()))
    assert sum(len(z.gpus) for r in topology.regions for z in r.zones) == 64
    assert len(topology.regions) == 3


def test_every_scenario_runs_in_quick_form(tmp_path: Path) -> None:
    code, text = run(
        [
            "run",
            "--quick",
            "--requests",
            "500",
            "--policies",
            "meridian,round_robin,greedy_clairvoyant",
            "--jobs",
            "1",
            "--no-plots",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0, text
    results = json.loads((tmp_path / "fleet.json").read_text())
    assert [s["name"] for s in results["scenarios"]] == [s.name for s in SCENARIOS]
    for scenario in results["scenarios"]:
        for name, policy in scenario["policies"].items():
            assert policy["offered"] > 0, (scenario["name"], name)
            assert policy["served"] + sum(policy["failed"].values()) == policy["offered"]
            if scenario["name"].startswith("steady-"):
                # Busy while loaded: the empty start and the drain are left out.
                assert policy["util_loaded_mean"] >= policy["util_mean"], (scenario["name"], name)
    lost = next(s for s in results["scenarios"] if s["name"] == "zone-then-region-lost")
    assert [label for _, label in lost["events"]][1].startswith("region ")
    markdown = (tmp_path / "fleet.md").read_text()
    assert "| `meridian` |" in markdown
    assert "## Simulation speed" in markdown
    assert "| steady-90 | `greedy_clairvoyant` | 500 |" in markdown


def test_a_trace_csv_replays(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"{0.05 * i:.2f},{200 + 10 * i},{20 + i % 7}" for i in range(120)]
    trace.write_text("\n".join(rows) + "\n")
    code, text = run(
        [
            "run",
            "--quick",
            "--workload",
            str(trace),
            "--scenarios",
            "steady-50",
            "--policies",
            "meridian",
            "--jobs",
            "1",
            "--no-plots",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0, text
    result = json.loads((tmp_path / "out" / "fleet.json").read_text())
    policy = result["scenarios"][0]["policies"]["meridian"]
    assert policy["served"] + sum(policy["failed"].values()) == policy["offered"] > 90


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--quick", "--policies", "meridian,nope"], "unknown policies ['nope']"),
        (["run", "--quick", "--scenarios", "storm"], "unknown scenarios ['storm']"),
        (["run", "--quick", "--requests", "0"], "--requests must be at least 1"),
        (["run", "--quick", "--workload", "nosuch.csv"], "neither conversation, code nor a CSV"),
        (["fleet", "--gpus", "0"], "--gpus must be at least 1"),
    ],
)
def test_bad_input_names_what_to_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(argv)[0] == 2
    assert message in capsys.readouterr().err


def test_a_bad_log_level_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MERIDIAN_LOG_LEVEL", "loud")
    assert run(["run", "--quick", "--requests", "10", "--no-plots"])[0] == 2
    assert "MERIDIAN_LOG_LEVEL='loud'" in capsys.readouterr().err


@pytest.mark.parametrize(("level", "shown"), [(None, False), ("warning", True)])
def test_a_run_keeps_the_tiers_warnings_quiet_unless_asked_and_the_callers_level_as_it_was(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    level: str | None,
    shown: bool,
) -> None:
    monkeypatch.delenv("MERIDIAN_LOG_LEVEL", raising=False)
    if level is not None:
        monkeypatch.setenv("MERIDIAN_LOG_LEVEL", level)
    root = logging.getLogger()
    before = root.level
    argv = ["run", "--quick", "--scenarios", "zone-then-region-lost", "--policies", "meridian"]
    argv += ["--requests", "800", "--jobs", "1", "--no-plots", "--out", str(tmp_path)]
    code, text = run(argv)
    assert code == 0, text
    # The zone is lost either way (the results say so); its warnings show only if asked.
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("zone us-east-1a marked down" in m for m in warned) is shown, warned[:5]
    assert root.level == before
    assert sim_log_level({}) == "error"


def test_a_malformed_trace_line_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,100,10\n0.1,abc,10\n")
    code, _ = run(
        [
            "run",
            "--quick",
            "--workload",
            str(trace),
            "--scenarios",
            "steady-50",
            "--policies",
            "meridian",
            "--jobs",
            "1",
            "--no-plots",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "bad.csv" in err and "line 3" in err


def test_an_empty_fleet_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "empty.yaml"
    fleet.write_text(
        yaml.safe_dump(
            {
                "redis_url": "redis://127.0.0.1:1/0",
                "global": {"listen": "127.0.0.1:1", "location": {"lat": 0, "lon": 0}},
                "regions": [],
            }
        )
    )
    code, _ = run(
        [
            "run",
            "--fleet",
            str(fleet),
            "--quick",
            "--jobs",
            "1",
            "--no-plots",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "meridian sim:" in err
