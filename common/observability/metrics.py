"""The metrics of one process, on ``prometheus_client``: its registry, families read at
scrape time, exposition with content negotiation, and readers for the process itself.

``process_registry()`` makes the one ``CollectorRegistry`` a tier process owns and
passes explicitly (never the library's global default): the library's process,
platform and GC collectors are registered on it, so ``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ``python_info`` and ``python_gc_*`` come with
every tier. Request metrics are ``prometheus_client`` Counters and Histograms on
that registry (``common.observability.tier_metrics``).

``ScrapeTimeFamily`` is a custom collector for values kept elsewhere (child health,
capacity-report age, queue depth, ejections): ``read()`` is called at scrape time,
so nothing is pushed on change and nothing is stored twice.

``exposition(registry, accept)`` renders what the scraper asked for: OpenMetrics
1.0 (with exemplars: the trace id of a latency observation) when its ``Accept``
names ``application/openmetrics-text``, else the Prometheus text format 0.0.4
(which has no exemplars).

``ExemplarMarks`` decides when a latency bucket takes a trace id as exemplar (at
most once a second per bucket: Prometheus keeps only the newest per scrape).

``counter_values`` and ``histogram_counts`` read a family back inside the process
(the dashboard's series, tests); they walk ``collect()``, the library's public view,
so they cost a pass over the family and are not for the request path.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# Seconds: from a cached short answer (~5 ms) to a long generation (minutes).
LLM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Seconds per output token: a fast decode (~1 ms) to a badly overloaded GPU (seconds).
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# A latency bucket takes a trace id as exemplar at most this often (ExemplarMarks).
EXEMPLAR_EVERY_S = 1.0

# (label values, value) of one sample of a scrape-time family.
Reading = tuple[tuple[str, ...], float]


def process_registry() -> CollectorRegistry:
    """A fresh registry for one process, with the process, platform and GC collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class ScrapeTimeFamily(Collector):
    """A gauge or counter family whose samples ``read()`` gives at scrape time.

    ``kind`` is "gauge" or "counter" (a running total kept elsewhere; its name is
    given without ``_total``, which the exposition adds). ``describe`` names the
    family without reading it, so registering checks for duplicates and costs nothing.
    """

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str],
        read: Callable[[], Iterable[Reading]],
        *,
        kind: str = "gauge",
        unit: str = "",
    ) -> None:
        if kind not in ("gauge", "counter"):
            raise ValueError(f"{name}: kind must be gauge or counter, got {kind!r}")
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self.read = read
        self.kind = kind
        self.unit = unit

    def _family(self) -> GaugeMetricFamily | CounterMetricFamily:
        make = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        return make(self.name, self.help, labels=self.labelnames, unit=self.unit)

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        family = self._family()
        for values, value in self.read():
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            family.add_metric(values, value)
        yield family


class Traced(Protocol):
    """What has a trace id (``CallRecord``); empty when it is not traced."""

    @property
    def trace_id(self) -> str: ...


class ExemplarMarks:
    """When each bucket of one latency histogram child may take its next exemplar.

    Prometheus keeps the newest exemplar of a bucket per scrape, and prometheus_client
    pays some 2 µs to validate and stamp each one; so a bucket takes one at most every
    ``EXEMPLAR_EVERY_S`` — every bucket, the rare slow ones too, still shows a recent
    trace id, and most requests skip the cost (and the trace id's formatting).
    """

    __slots__ = ("due",)

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.due = [0.0] * (len(bounds) + 1)

    def exemplar(
        self, bounds: tuple[float, ...], value: float, now: float, call: Traced
    ) -> dict[str, str] | None:
        i = bisect.bisect_left(bounds, value)  # the bucket prometheus_client counts it in
        if now < self.due[i]:
            return None
        trace_id = call.trace_id
        if not trace_id:
            return None
        self.due[i] = now + EXEMPLAR_EVERY_S
        return {"trace_id": trace_id}


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry rendered for a scraper's ``Accept`` header, and its content type."""
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type


def _samples(family: MetricWrapperBase) -> Iterator[Sample]:
    for metric in family.collect():
        yield from metric.samples


def counter_values(
    family: MetricWrapperBase, labelnames: Sequence[str]
) -> dict[tuple[str, ...], float]:
    """A counter's (or gauge's) values summed by ``labelnames`` (in that order), as
    PromQL's ``sum by``; every label named gives each label tuple its own value."""
    out: dict[tuple[str, ...], float] = {}
    for sample in _samples(family):
        if sample.name.endswith("_created"):
            continue
        key = tuple(sample.labels[k] for k in labelnames)
        out[key] = out.get(key, 0.0) + sample.value
    return out


def histogram_counts(
    family: MetricWrapperBase, labelnames: Sequence[str]
) -> dict[tuple[str, ...], list[float]]:
    """A histogram's observations summed by ``labelnames``, counted per bucket (not
    cumulatively: one entry per finite bound, then the +Inf bucket)."""
    out: dict[tuple[str, ...], list[float]] = {}
    for metric in family.collect():
        runs: dict[tuple[tuple[str, str], ...], list[float]] = {}
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                series = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                runs.setdefault(series, []).append(sample.value)
        for series, run in runs.items():
            labels = dict(series)
            key = tuple(labels[k] for k in labelnames)
            counts = [c - p for c, p in zip(run, [0.0, *run[:-1]], strict=True)]
            total = out.get(key)
            out[key] = (
                counts if total is None else [a + b for a, b in zip(total, counts, strict=True)]
            )
    return out
