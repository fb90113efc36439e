"""The metrics registry renders valid Prometheus text exposition 0.0.4."""

from __future__ import annotations

import math
import re

import pytest

from common.observability.metrics import CallbackGauge, Registry, escape_label
from common.observability.tier_metrics import CountingRetryBudget
from common.request.resilience import RetryBudgetConfig

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL_VALUE = r'"(?:[^"\\\n]|\\\\|\\"|\\n)*"'
LABELS = rf"\{{(?:{NAME}={LABEL_VALUE}(?:,{NAME}={LABEL_VALUE})*)?\}}"
SAMPLE = re.compile(rf"^({NAME})({LABELS})? (\S+)$")
PAIR = re.compile(rf"({NAME})=({LABEL_VALUE})")


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
    """Every non-comment line as (name, labels, value); fails on any malformed line."""
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


def test_counter_and_gauge_render_with_help_and_type() -> None:
    registry = Registry()
    requests = registry.counter("demo_requests_total", "Calls.", ("tier", "status"))
    requests.labels("global", "OK").inc()
    requests.labels("global", "OK").inc(2)
    requests.labels("global", "UNAVAILABLE").inc()
    registry.gauge("demo_depth", "Depth.").labels().set(4)
    text = registry.render()
    assert "# HELP demo_requests_total Calls.\n# TYPE demo_requests_total counter\n" in text
    assert "# TYPE demo_depth gauge" in text
    samples = parse(text)
    assert ("demo_requests_total", {"tier": "global", "status": "OK"}, 3.0) in samples
    assert ("demo_requests_total", {"tier": "global", "status": "UNAVAILABLE"}, 1.0) in samples
    assert ("demo_depth", {}, 4.0) in samples


def test_histogram_buckets_are_cumulative_and_inf_equals_count() -> None:
    registry = Registry()
    latency = registry.histogram("demo_seconds", "Latency.", ("model",), buckets=(0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 2.0, 20.0, 30.0):
        latency.labels("m").observe(value)
    samples = parse(registry.render())
    buckets = [(s[1]["le"], s[2]) for s in samples if s[0] == "demo_seconds_bucket"]
    assert buckets == [("0.1", 2.0), ("1", 3.0), ("10", 4.0), ("+Inf", 6.0)]
    counts = [v for n, _, v in samples if n == "demo_seconds_count"]
    sums = [v for n, _, v in samples if n == "demo_seconds_sum"]
    assert counts == [6.0] and sums == [pytest.approx(52.65)]
    values = [v for _, v in buckets]
    assert values == sorted(values)


def test_label_values_are_escaped() -> None:
    registry = Registry()
    weird = 'a "quoted" back\\slash\nnewline'
    registry.counter("demo_total", "Weird labels.", ("tenant",)).labels(weird).inc()
    text = registry.render()
    assert escape_label(weird) in text
    assert parse(text) == [("demo_total", {"tenant": weird}, 1.0)]


def test_callback_gauge_is_read_at_scrape_time_and_nan_renders() -> None:
    registry = Registry()
    depth = {"critical": 0, "standard": 2}
    registry.register(
        CallbackGauge(
            "demo_queue_depth",
            "Queue.",
            ("priority",),
            lambda: (((p,), float(n)) for p, n in depth.items()),
        )
    )
    registry.register(CallbackGauge("demo_age_seconds", "Age.", (), lambda: [((), math.nan)]))
    depth["standard"] = 5
    samples = parse(registry.render())
    assert ("demo_queue_depth", {"priority": "standard"}, 5.0) in samples
    ages = [v for n, _, v in samples if n == "demo_age_seconds"]
    assert len(ages) == 1 and math.isnan(ages[0])


def test_wrong_label_count_and_duplicate_names_are_refused() -> None:
    registry = Registry()
    family = registry.counter("demo_total", "Calls.", ("tier",))
    with pytest.raises(ValueError, match="expected labels"):
        family.labels("a", "b")
    with pytest.raises(ValueError, match="registered twice"):
        registry.gauge("demo_total", "Again.")
    with pytest.raises(ValueError, match="only goes up"):
        family.labels("a").inc(-1)


def test_empty_families_render_only_their_header() -> None:
    registry = Registry()
    registry.histogram("demo_seconds", "Latency.", ("model",))
    assert parse(registry.render()) == []


def test_counting_retry_budget_counts_only_retries_it_lets_start() -> None:
    registry = Registry()
    retries = registry.counter("demo_retries_total", "Retries.", ("tier",)).labels("local")
    budget = CountingRetryBudget(retries, RetryBudgetConfig(min_retry_concurrency=1))
    assert budget.try_start_retry()
    assert not budget.try_start_retry()  # the budget is spent: refused, not counted
    budget.retry_finished()
    assert budget.try_start_retry()
    assert retries.value == 2.0
