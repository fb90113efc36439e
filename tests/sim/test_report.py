"""write_results: fleet.json reads back, fleet.md has a row per policy and bolds the best,
the PNGs are real PNGs (when matplotlib is installed) or are skipped with a message."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import random
from pathlib import Path

import pytest

from common.basics.geo import GeoPoint
from sim.measure import PolicyResult, Recorder, Slo
from sim.report import NO_MATPLOTLIB, RunResults, ScenarioResult, write_results
from sim.requests import SimRequest
from sim.tables import seconds
from tests.sim.test_measure import FakeGpu

POLICIES = {"meridian": 1.0, "round-robin": 1.6, "random": 1.9, "greedy_clairvoyant": 0.8}
REGIONS = ("eu-west", "us-east")


def policy_run(scale: float, seed: int, events: list[tuple[float, str]]) -> PolicyResult:
    """120 s of 10 arrivals a second whose e2e grows with ``scale`` (and doubles for 20 s
    after the first event, if any)."""
    rng = random.Random(seed)
    rec = Recorder(slo=Slo(ttft_s=0.5, e2e_s=3.0))
    hit = events[0][0] if events else None
    for i in range(1200):
        at = i / 10
        slow = 2.0 if hit is not None and hit <= at < hit + 20 else 1.0
        e2e = scale * slow * rng.uniform(0.5, 2.5)
        home = REGIONS[i % 2]
        region = home if rng.random() < 0.9 else REGIONS[(i + 1) % 2]
        req = SimRequest(
            i, at, "Paris", GeoPoint(48.9, 2.3), "acme" if i % 3 else "beta", 10, 5, max_tokens=5
        )
        rec.served(
            req,
            region=region,
            zone="z",
            gpu="g",
            home_region=home,
            rtt_ms=20.0,
            ttft_s=e2e / 10,
            e2e_s=e2e,
            cached_tokens=0,
            attempts=1,
        )
    gpus = [FakeGpu(f"g{k}", busy_s=120.0 * (0.5 + k / 20) / scale, slot_s=10.0) for k in range(8)]
    return rec.finish(gpus, duration_s=120.0, events=events)


def scenario(name: str, load: float, events: list[tuple[float, str]]) -> ScenarioResult:
    policies = {p: policy_run(s, i, events) for i, (p, s) in enumerate(POLICIES.items())}
    return ScenarioResult(name, f"{name} for the test", load, events, policies)


@pytest.fixture(scope="module")
def run() -> RunResults:
    return RunResults(
        meta={"seed": 7, "fleet": "test fleet", "gpus": 8},
        scenarios=[
            scenario("steady-50", 0.5, []),
            scenario("steady-90", 0.9, []),
            scenario("zone-lost", 0.9, [(60.0, "zone eu-west-a lost")]),
        ],
    )


def table(markdown: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The first table after ``heading``: its header cells and its rows' cells."""
    lines = markdown[markdown.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| policy"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows[0], rows[2:]


def test_the_run_survives_a_strict_json_round_trip(run: RunResults) -> None:
    text = json.dumps(run.to_json(), allow_nan=False)
    assert RunResults.from_json(json.loads(text)) == run


def test_fleet_json_holds_everything(tmp_path: Path, run: RunResults) -> None:
    write_results(tmp_path, run, plots=False)
    back = RunResults.from_json(json.loads((tmp_path / "fleet.json").read_text()))
    assert back == run


def test_markdown_has_a_row_per_policy_and_bolds_the_best_but_never_a_reference(
    tmp_path: Path, run: RunResults
) -> None:
    write_results(tmp_path, run, plots=False)
    md = (tmp_path / "fleet.md").read_text()
    for s in run.scenarios:
        headers, rows = table(md, f"## {s.name}")
        assert [r[0] for r in rows] == [
            "`meridian`",
            "`round-robin`",
            "`random`",
            "*greedy_clairvoyant* (clairvoyant reference, not a bound)",
        ]
        p99 = headers.index("e2e P99")
        others = {n: r.e2e_p99_s for n, r in s.policies.items() if n != "greedy_clairvoyant"}
        best = min(others, key=lambda n: others[n] or 0.0)
        for name, row in zip(s.policies, rows, strict=True):
            text = seconds(s.policies[name].e2e_p99_s)
            assert row[p99] == (f"**{text}**" if name == best else text)
        # No bound in this run: nothing to divide by.
        assert rows[0][headers.index("e2e P99 ×bound")] == "–"
        goodput = headers.index("goodput")
        good = {n: r.goodput or 0.0 for n, r in s.policies.items() if n != "greedy_clairvoyant"}
        top = max(good, key=lambda n: good[n])
        assert rows[list(s.policies).index(top)][goodput].startswith("**")
        assert not rows[-1][goodput].startswith("**")


def test_markdown_reports_recovery_and_a_headline_across_steady_loads(
    tmp_path: Path, run: RunResults
) -> None:
    write_results(tmp_path, run, plots=False)
    md = (tmp_path / "fleet.md").read_text()
    headers, rows = table(md, "## Headline")
    assert headers[1:] == [
        "TTFT P99 @ 50%",
        "e2e P99 @ 50%",
        "goodput @ 50%",
        "TTFT P99 @ 90%",
        "e2e P99 @ 90%",
        "goodput @ 90%",
    ]
    assert len(rows) == len(POLICIES)
    headers, rows = table(md, "## zone-lost")
    zone = run.scenarios[2]
    recovery = zone.policies["meridian"].recoveries[0].recovery_s
    assert recovery is not None
    assert rows[0][headers.index("recovery")].strip("*") == f"{recovery:.0f} s"
    assert "- 60 s: zone eu-west-a lost" in md


def test_write_results_draws_valid_pngs(tmp_path: Path, run: RunResults) -> None:
    pytest.importorskip("matplotlib")
    paths = write_results(tmp_path, run)
    names = [p.name for p in paths]
    assert names == [
        "fleet.json",
        "fleet.md",
        "latency_vs_load.png",
        "utilisation_cdf.png",
        "timeline_zone-lost.png",
    ]
    for path in paths[2:]:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert 5_000 < len(data) < 300_000
    md = (tmp_path / "fleet.md").read_text()
    assert "![latency_vs_load](latency_vs_load.png)" in md
    assert "![timeline of zone-lost](timeline_zone-lost.png)" in md


def test_plots_false_writes_no_png_and_says_so(
    tmp_path: Path, run: RunResults, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="sim.report"):
        paths = write_results(tmp_path, run, plots=False)
    assert [p.name for p in paths] == ["fleet.json", "fleet.md"]
    assert list(tmp_path.glob("*.png")) == []
    assert "plots skipped (plots=False)" in caplog.text


def test_without_matplotlib_it_says_so_once_and_writes_the_rest(
    tmp_path: Path,
    run: RunResults,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with caplog.at_level(logging.WARNING, logger="sim.report"):
        paths = write_results(tmp_path, run)
    assert [p.name for p in paths] == ["fleet.json", "fleet.md"]
    assert caplog.text.count(NO_MATPLOTLIB) == 1
    assert "matplotlib is not installed" in (tmp_path / "fleet.md").read_text()


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "–"), (0.0123, "12 ms"), (0.9994, "999 ms"), (1.0, "1.00 s"), (12.34, "12.3 s")],
)
def test_seconds_print_in_the_unit_that_reads_best(value: float | None, text: str) -> None:
    assert seconds(value) == text


def test_every_policy_is_shown_as_times_the_bound_and_the_bound_is_last_never_bold(
    tmp_path: Path, run: RunResults
) -> None:
    s = run.scenarios[0]
    mine = s.policies["meridian"]
    assert mine.e2e_p99_s is not None and mine.ttft_p99_s is not None
    s.policies["bound"] = dataclasses.replace(
        mine, e2e_p99_s=mine.e2e_p99_s / 4, ttft_p99_s=mine.ttft_p99_s / 2, goodput=1.0
    )
    s.policies["meridian"] = dataclasses.replace(mine, e2e_p99_s=math.inf)
    write_results(tmp_path, run, plots=False)
    headers, rows = table((tmp_path / "fleet.md").read_text(), f"## {s.name}")
    assert rows[-1][0] == "*bound* (lower bound)"
    assert rows[0][headers.index("TTFT P99 ×bound")] == "**2.00×**"
    # A P99 among the failures prints as ∞, and so does its ratio.
    assert rows[0][headers.index("e2e P99")] == "∞"
    assert rows[0][headers.index("e2e P99 ×bound")] == "∞"
    assert rows[-1][headers.index("goodput")] == "100.0%"  # the best, but not a router
