"""The process registry on prometheus_client: scrape-time families, readers, and the
exposition each scraper asks for (text 0.0.4, or OpenMetrics with exemplars)."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from common.observability.metrics import (
    ScrapeTimeFamily,
    counter_values,
    exposition,
    histogram_counts,
    process_registry,
)
from common.observability.tier_metrics import CountingRetryBudget
from common.request.resilience import RetryBudgetConfig

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_VALUE = r'"(?:[^"\\\n]|\\\\|\\"|\\n)*"'
LABELS = rf"\{{(?:{NAME}={LABEL_VALUE}(?:,{NAME}={LABEL_VALUE})*)?\}}"
SAMPLE = re.compile(rf"^({NAME})({LABELS})? (\S+)$")
PAIR = re.compile(rf"({NAME})=({LABEL_VALUE})")
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# What Prometheus 2.x sends when it scrapes.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def unescape(quoted: str) -> str:
    out, i, body = [], 0, quoted[1:-1]
    while i < len(body):
        if body[i] == "\\":
            out.append({"n": "\n", "\\": "\\", '"': '"'}[body[i + 1]])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample line of text format 0.0.4 as (name, labels, value); fails on any
    malformed line."""
    assert text.endswith("\n")
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")), line
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        pairs = {k: unescape(v) for k, v in PAIR.findall(labels or "")}
        samples.append((name, pairs, float(value)))
    return samples


def plain(registry: CollectorRegistry) -> str:
    body, content_type = exposition(registry, None)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    return body.decode()


def test_a_process_registry_carries_process_and_python_metrics() -> None:
    names = {name for name, _, _ in parse(plain(process_registry()))}
    assert {"python_info", "python_gc_collections_total"} <= names
    assert "process_cpu_seconds_total" in names  # Linux: read from /proc


def test_each_process_registry_is_its_own() -> None:
    one, two = process_registry(), process_registry()
    Counter("demo_calls", "Calls.", registry=one).inc()
    assert "demo_calls_total" not in plain(two)
    Counter("demo_calls", "Calls.", registry=two)  # no clash: not the global default


def test_scrape_time_family_is_read_at_scrape_and_nan_renders() -> None:
    registry = CollectorRegistry()
    depth = {"critical": 0, "standard": 2}
    registry.register(
        ScrapeTimeFamily(
            "demo_queue_depth",
            "Queue.",
            ("priority",),
            lambda: (((p,), float(n)) for p, n in depth.items()),
        )
    )
    registry.register(ScrapeTimeFamily("demo_age_seconds", "Age.", (), lambda: [((), math.nan)]))
    registry.register(
        ScrapeTimeFamily("demo_ejections", "Total.", (), lambda: [((), 3.0)], kind="counter")
    )
    depth["standard"] = 5
    text = plain(registry)
    samples = parse(text)
    assert ("demo_queue_depth", {"priority": "standard"}, 5.0) in samples
    ages = [v for n, _, v in samples if n == "demo_age_seconds"]
    assert len(ages) == 1 and math.isnan(ages[0])
    assert ("demo_ejections_total", {}, 3.0) in samples
    assert "# TYPE demo_ejections_total counter" in text


def test_scrape_time_family_refuses_a_wrong_label_count_and_a_duplicate_name() -> None:
    registry = CollectorRegistry()
    registry.register(ScrapeTimeFamily("demo_x", "X.", ("a",), lambda: [(("1", "2"), 1.0)]))
    with pytest.raises(ValueError, match="expected labels"):
        plain(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(ScrapeTimeFamily("demo_x", "Again.", (), lambda: []))
    with pytest.raises(ValueError, match="kind"):
        ScrapeTimeFamily("demo_y", "Y.", (), lambda: [], kind="summary")


def test_label_values_are_escaped() -> None:
    registry = CollectorRegistry()
    weird = 'a "quoted" back\\slash\nnewline'
    Counter("demo", "Weird labels.", ("tenant",), registry=registry).labels(weird).inc()
    samples = [s for s in parse(plain(registry)) if s[0] == "demo_total"]
    assert samples == [("demo_total", {"tenant": weird}, 1.0)]


def test_readers_sum_by_the_labels_named() -> None:
    registry = CollectorRegistry()
    calls = Counter("demo", "Calls.", ("tier", "status"), registry=registry)
    calls.labels("global", "OK").inc(3)
    calls.labels("local", "OK").inc()
    calls.labels("local", "UNAVAILABLE").inc()
    assert counter_values(calls, ("status",)) == {("OK",): 4.0, ("UNAVAILABLE",): 1.0}
    assert counter_values(calls, ("tier", "status"))[("global", "OK")] == 3.0
    latency = Histogram("demo_seconds", "L.", ("m",), registry=registry, buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 5.0):
        latency.labels("a").observe(value)
    latency.labels("b").observe(0.05)
    assert histogram_counts(latency, ("m",)) == {("a",): [1, 2, 1], ("b",): [1, 0, 0]}
    assert histogram_counts(latency, ()) == {(): [2, 2, 1]}


def test_plain_text_by_default_openmetrics_with_exemplars_when_asked() -> None:
    registry = CollectorRegistry()
    latency = Histogram("demo_seconds", "L.", ("m",), registry=registry, buckets=(0.1, 1.0))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    latency.labels("a").observe(0.5, {"trace_id": trace_id})
    text = plain(registry)
    assert trace_id not in text  # text 0.0.4 has no exemplars
    for accept in (OPENMETRICS, PROMETHEUS_ACCEPT):
        body, content_type = exposition(registry, accept)
        assert content_type.startswith("application/openmetrics-text; version=1.0.0")
        om = body.decode()
        assert om.endswith("# EOF\n")
        [family] = [f for f in text_string_to_metric_families(om) if f.name == "demo_seconds"]
        exemplars = {s.labels["le"]: s.exemplar for s in family.samples if s.exemplar}
        assert list(exemplars) == ["1.0"]
        assert exemplars["1.0"].labels == {"trace_id": trace_id}
        assert exemplars["1.0"].value == 0.5


def test_counting_retry_budget_counts_only_retries_it_lets_start() -> None:
    registry = CollectorRegistry()
    retries = Counter("demo_retries", "Retries.", ("tier",), registry=registry)
    config = RetryBudgetConfig(min_retry_concurrency=1)
    budget = CountingRetryBudget(retries.labels("local"), config)
    assert budget.try_start_retry()
    assert not budget.try_start_retry()  # the budget is spent: refused, not counted
    budget.retry_finished()
    assert budget.try_start_retry()
    assert counter_values(retries, ("tier",)) == {("local",): 2.0}
