"""Dashboards and alerts as code (deploy/grafana, deploy/prometheus): valid as their
tools read them, and every metric they query exists in the live /metrics of the tier it
belongs to — a real fleet (global, regional, two local tiers, emulated GPUs, Redis).
Each tier's /metrics passes `promtool check metrics` too."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cli.launcher import Fleet
from tests.client import V2Client
from tests.conftest import start_fleet
from tests.e2e.test_ops import addresses, get, ops_spec

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "meridian.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"

# A metric in a PromQL expression, with its matchers if it has any.
METRIC = re.compile(
    r"\b(meridian_[a-z0-9_]+|process_[a-z0-9_]+|python_[a-z0-9_]+|up)\b(\{[^}]*\})?"
)
TIER = re.compile(r'tier="([a-z]+)"')
# Series Prometheus makes itself for every target, never in a /metrics.
SCRAPE_SERIES = frozenset({"up"})
SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("",), "gauge": ("",)}


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; `make promtool`)")
    return subprocess.run([tool, *args], input=stdin, capture_output=True, text=True, timeout=60)


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def queried(exprs: list[str]) -> set[tuple[str, str | None]]:
    """Every (metric, tier it is asked of, or None) the expressions query."""
    out = set()
    for expr in exprs:
        for name, matchers in METRIC.findall(expr):
            tier = TIER.search(matchers or "")
            out.add((name, tier.group(1) if tier else None))
    return out


def exposed(text: str) -> set[str]:
    """The series names a /metrics (text 0.0.4) offers, from its TYPE lines, so a
    family counts before its first observation too."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.update(name + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def test_alert_rules_pass_promtool() -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_alerts_fire_when_their_failure_happens() -> None:
    """promtool's rule unit tests (alerts_test.yml): region down, stale summaries, Redis
    unreachable, shedding, ejections fire on series shaped like a tier's, and not before."""
    done = promtool("test", "rules", str(ALERT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_example_scrape_config_passes_promtool() -> None:
    done = promtool("check", "config", str(SCRAPE_CONFIG))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_names_the_failure_and_has_a_severity() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    for failure in (
        "MeridianRegionDown",
        "MeridianCapacitySummariesStale",
        "MeridianRedisUnreachable",
        "MeridianShedding",
        "MeridianGpuEjections",
    ):
        assert failure in alerts
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_the_dashboard_queries_through_its_datasource_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    [variable] = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    ref = f"${{{variable['name']}}}"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == ref, panel["title"]
        assert panel["targets"], panel["title"]
    titles = {r["title"] for r in dash["panels"] if r["type"] == "row"}
    assert titles == {"Fleet", "Tiers", "LLM latency", "Tenants", "Capacity flow"}
    names = {name for name, _ in queried(dashboard_exprs())}
    for wanted in (
        "meridian_time_to_first_token_seconds_bucket",
        "meridian_time_per_output_token_seconds_bucket",
        "meridian_queue_wait_seconds_bucket",
        "meridian_child_capacity_report_age_seconds",
        "meridian_generation_tokens_total",
    ):
        assert wanted in names


@pytest.fixture(scope="module")
def tier_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[str]]]:
    """Each tier kind's /metrics bodies, from a live fleet that answered a request."""
    fleet = start_fleet(tmp_path_factory.mktemp("deploy"), ops_spec())
    try:
        yield scrape(fleet)
    finally:
        fleet.stop()


def scrape(fleet: Fleet) -> dict[str, list[str]]:
    with V2Client(fleet.global_address) as client:
        client.infer()
    out: dict[str, list[str]] = {}
    for name, address in addresses(fleet).items():
        status, text = get(address, "/metrics")
        assert status == 200
        tier = name if name in ("global", "regional") else "local"
        out.setdefault(tier, []).append(text)
    return out


def test_every_tier_passes_promtool_check_metrics(tier_metrics: dict[str, list[str]]) -> None:
    assert sorted(tier_metrics) == ["global", "local", "regional"]
    for tier, bodies in tier_metrics.items():
        for text in bodies:
            done = promtool("check", "metrics", stdin=text)
            problems = (done.stdout + done.stderr).strip()
            assert done.returncode == 0 and not problems, f"{tier}: {problems}"


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_queried_exists_in_a_live_tier(
    source: str, tier_metrics: dict[str, list[str]]
) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    by_tier = {
        tier: set.intersection(*(exposed(text) for text in bodies))
        for tier, bodies in tier_metrics.items()
    }
    anywhere = set.union(*by_tier.values())
    missing = []
    for name, tier in sorted(queried(exprs), key=str):
        if name in SCRAPE_SERIES:
            continue
        offered = anywhere if tier is None else by_tier.get(tier, set())
        if name not in offered:
            missing.append(f"{name} (tier {tier or 'any'})")
    assert missing == [], f"{source} queries metrics no tier exposes: {missing}"


def test_a_renamed_metric_would_be_caught(tier_metrics: dict[str, list[str]]) -> None:
    """The check above is not vacuous: a query of an old name finds it missing."""
    names = set.union(*(exposed(t) for bodies in tier_metrics.values() for t in bodies))
    assert ("meridian_child_summary_age_seconds", None) in queried(
        ["max(meridian_child_summary_age_seconds)"]
    )
    assert "meridian_child_summary_age_seconds" not in names
    assert "meridian_requests_total" in names
