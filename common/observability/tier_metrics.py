"""A tier's metric definitions on its own ``prometheus_client`` registry.

``TierMetrics`` owns the tier process's registry (``metrics.process_registry``) and
its families. Request metrics are recorded when the call interceptor
(``common.request.call``) says a request ended — a ModelInfer call, or one request
of a ModelStreamInfer (each counted on its own) — from what its ``CallRecord``
says: status, latency, time to first response, token counts. So the request path
makes no metric call; streams themselves are counted apart, by how they ended.
Child health, capacity-report age, queue depth and ejections are read at scrape
time (``ScrapeTimeFamily``); decisions and queue waits are counted by the
``DecisionCounter`` around the tier's balancer (``common.observability.decisions``),
retries by the ``CountingRetryBudget``.

LLM latency, per tier, model and tenant:

* ``meridian_time_to_first_token_seconds``: from receiving the request to its first
  response sent back (``CallRecord.first_response_s``; a unary answer is its first
  and last response, so there it equals the request latency);
* ``meridian_time_per_output_token_seconds``: for a streamed request that ended OK
  with more than one token, ``(latency - time to first token) / (tokens - 1)``. A
  unary answer (or ``stream: false``) shows no token timing, so none is observed
  rather than a figure that would be its prefill and queueing spread over tokens.

Token counters count what the record says (the GPU's own counts once it reports
them, the estimate otherwise) for requests that got a response.

Labels are bounded: ``model`` is a configured model or ``-``, ``tenant`` a
configured tenant id or ``-``, ``status`` a gRPC status code name, ``reason`` one of
``SHED_REASONS`` (or "capacity") or a decision reason (``decisions.DECISION_REASONS``).
The children of each (model, tenant, status) are looked up once and cached, so a
request costs one dict lookup plus the library's increments.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Histogram

from common.observability.metrics import (
    LLM_BUCKETS,
    TOKEN_BUCKETS,
    ExemplarMarks,
    Reading,
    ScrapeTimeFamily,
    process_registry,
)
from common.request.balancer import Lease
from common.request.call import CallRecord
from common.request.children import ChildSet
from common.request.pick import PickRequest
from common.request.resilience import RetryBudget, RetryBudgetConfig

UNKNOWN_LABEL = "-"
# The label names of meridian_requests_total and meridian_request_duration_seconds.
REQUEST_LABELS = ("tier", "model", "status", "tenant")
STREAM_LABELS = ("tier", "status", "tenant")

SHED_REASONS = ("requests_per_s", "tokens_per_min", "max_concurrent", "max_open_streams_per_tenant")


def shed_reason(message: str) -> str:
    """A bounded reason for a RESOURCE_EXHAUSTED answer, from its message."""
    for limit in SHED_REASONS:
        if limit in message:
            return limit
    return "capacity"


@dataclass(slots=True)
class _Series:
    """The children one (model, tenant, status) of a tier records into."""

    requests: Counter
    duration: Histogram
    ttft: Histogram
    tpot: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    duration_marks: ExemplarMarks
    ttft_marks: ExemplarMarks


class TierMetrics:
    """The metric families of one tier process and the readers of its children."""

    def __init__(
        self,
        tier: str,
        children: ChildSet,
        *,
        models: Collection[str] = (),
        tenants: Collection[str] = (),
        summaries: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self.clock = clock  # when buckets take exemplars (ExemplarMarks)
        self.children = children
        self.models = frozenset(models)
        self.tenants = frozenset(tenants)
        self.registry = process_registry()
        self._add_request_families()
        self._add_tier_families()
        self.queue_wait: Histogram | None = None  # the local tier's (add_local_metrics)
        self._series: dict[tuple[str, str, grpc.StatusCode], _Series] = {}
        self._decided: dict[tuple[str, str], Counter] = {}
        self._waits: dict[tuple[str, str], Histogram] = {}
        self.scraped(
            "meridian_child_healthy",
            "1 while direct evidence says the child is up, else 0.",
            ("tier", "child"),
            self._child_health,
        )
        if summaries:
            self._add_summary_families()

    def _add_request_families(self) -> None:
        """Per request: count, latency, LLM latencies and tokens."""
        r, request, llm = self.registry, REQUEST_LABELS, ("tier", "model", "tenant")
        self.requests = Counter(
            "meridian_requests",
            "Inference requests answered by this tier (a ModelInfer "
            "call, or one request of a stream), by final gRPC status.",
            request,
            registry=r,
        )
        self.streams = Counter(
            "meridian_streams",
            "ModelStreamInfer calls ended at this tier, by final gRPC "
            "status (their requests are counted in meridian_requests_total).",
            STREAM_LABELS,
            registry=r,
        )
        self.duration = Histogram(
            "meridian_request_duration_seconds",
            "Time from receiving an inference request to its last response.",
            request,
            registry=r,
            buckets=LLM_BUCKETS,
        )
        self.ttft = Histogram(
            "meridian_time_to_first_token_seconds",
            "Time from receiving an inference request to its first response sent back.",
            llm,
            registry=r,
            buckets=LLM_BUCKETS,
        )
        self.tpot = Histogram(
            "meridian_time_per_output_token_seconds",
            "Time per output token after the first, of streamed requests that ended OK.",
            llm,
            registry=r,
            buckets=TOKEN_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "meridian_prompt_tokens",
            "Prompt tokens of requests that got a response.",
            llm,
            registry=r,
        )
        self.generation_tokens = Counter(
            "meridian_generation_tokens",
            "Tokens generated for requests that got a response.",
            llm,
            registry=r,
        )

    def _add_tier_families(self) -> None:
        """What the tier did about requests: retries, sheds, decisions."""
        r = self.registry
        self.retries = Counter(
            "meridian_retries",
            "Retries to another live child that took a slot of the retry "
            "budget (failovers away from a child found down are not retries).",
            ("tier",),
            registry=r,
        )
        self.sheds = Counter(
            "meridian_sheds",
            "Requests refused with RESOURCE_EXHAUSTED (a tenant limit, or no capacity), by reason.",
            ("tier", "tenant", "reason"),
            registry=r,
        )
        self.decisions = Counter(
            "meridian_decisions",
            "Children chosen (or refusals) by this tier's balancer, by the reason of the choice.",
            ("tier", "model", "reason"),
            registry=r,
        )

    def scraped(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...],
        read: Callable[[], Iterable[Reading]],
        kind: str = "gauge",
    ) -> None:
        """Add a family whose samples ``read()`` gives at scrape time."""
        self.registry.register(ScrapeTimeFamily(name, help_text, labels, read, kind=kind))

    def _add_summary_families(self) -> None:
        labels = ("tier", "child")
        self.scraped(
            "meridian_child_capacity_report_age_seconds",
            "Age of the child's newest capacity summary; NaN when none arrived.",
            labels,
            self._summary_ages,
        )
        self.scraped(
            "meridian_child_capacity_report_fresh",
            "1 while the child's newest "
            "capacity summary is within its TTL (else the child is routed to on "
            "direct evidence only), else 0.",
            labels,
            self._summary_fresh,
        )
        self.scraped(
            "meridian_capacity_report_ttl_seconds",
            "Age past which a capacity summary counts as unknown.",
            ("tier",),
            lambda: [((self.tier,), self.children.summary_ttl_s)],
        )

    def _child_health(self) -> Iterable[Reading]:
        for child in self.children:
            yield (self.tier, child.name), 1.0 if child.healthy else 0.0

    def _summary_ages(self) -> Iterable[Reading]:
        now = self.children.clock()
        for child in self.children:
            age = math.nan if child.summary is None else now - child.summary_received_at
            yield (self.tier, child.name), age

    def _summary_fresh(self) -> Iterable[Reading]:
        now, ttl = self.children.clock(), self.children.summary_ttl_s
        for child in self.children:
            yield (self.tier, child.name), 0.0 if child.fresh_summary(now, ttl) is None else 1.0

    def model_label(self, model: str) -> str:
        return model if model in self.models else UNKNOWN_LABEL

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self.tenants else UNKNOWN_LABEL

    def _series_of(self, model: str, tenant: str, code: grpc.StatusCode) -> _Series:
        key = (model, tenant, code)
        series = self._series.get(key)
        if series is None:
            t = self.tier
            series = self._series[key] = _Series(
                self.requests.labels(t, model, code.name, tenant),
                self.duration.labels(t, model, code.name, tenant),
                self.ttft.labels(t, model, tenant),
                self.tpot.labels(t, model, tenant),
                self.prompt_tokens.labels(t, model, tenant),
                self.generation_tokens.labels(t, model, tenant),
                ExemplarMarks(LLM_BUCKETS),
                ExemplarMarks(LLM_BUCKETS),
            )
        return series

    def record(self, call: CallRecord, tenant: str) -> None:
        """One request ended (``call.code`` set): count it and observe its latencies."""
        code, elapsed = call.code, call.elapsed_s
        series = self._series_of(self.model_label(call.model), tenant, code)
        series.requests.inc()
        now = self.clock()
        marks = series.duration_marks
        series.duration.observe(elapsed, marks.exemplar(LLM_BUCKETS, elapsed, now, call))
        first = call.first_response_s
        if first is not None:
            marks = series.ttft_marks
            series.ttft.observe(first, marks.exemplar(LLM_BUCKETS, first, now, call))
            series.prompt_tokens.inc(call.prompt_tokens)
            series.generation_tokens.inc(call.completion_tokens)
            if call.streamed and code is grpc.StatusCode.OK and call.completion_tokens > 1:
                series.tpot.observe(max(0.0, elapsed - first) / (call.completion_tokens - 1))
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.sheds.labels(self.tier, tenant, shed_reason(call.detail)).inc()

    # As a CallObserver of the call interceptor (common.request.call): the tenant is
    # the one the proxy resolved, so it is right at the edge too.
    def call_started(self, call: CallRecord) -> None:
        return None

    def call_ended(self, call: CallRecord) -> None:
        tenant = self.tenant_label(call.tenant)
        if call.carries_requests:
            self.streams.labels(self.tier, call.code.name, tenant).inc()
            # A stream refused as a whole (its requests' refusals count as they end).
            if call.code is grpc.StatusCode.RESOURCE_EXHAUSTED and not call.requests:
                self.sheds.labels(self.tier, tenant, shed_reason(call.detail)).inc()
            return
        self.record(call, tenant)

    def decided(self, pick: PickRequest, reason: str, lease: Lease | None) -> None:
        """The balancer chose (``lease``) or refused: count the decision by its reason,
        and at the local tier how long the request waited for its GPU slot."""
        model = self.model_label(pick.model)
        key = (model, reason)
        counter = self._decided.get(key)
        if counter is None:
            counter = self._decided[key] = self.decisions.labels(self.tier, model, reason)
        counter.inc()
        if self.queue_wait is not None and lease is not None:
            tenant = self.tenant_label(pick.tenant)
            wait = self._waits.get((model, tenant))
            if wait is None:
                wait = self._waits[(model, tenant)] = self.queue_wait.labels(
                    self.tier, model, tenant
                )
            wait.observe(lease.queued_s or 0.0)


class CountingRetryBudget(RetryBudget):
    """A retry budget that counts the retries it lets start (``TierServer`` gives one
    to its proxy, so the request path needs no metric call)."""

    def __init__(self, counter: Counter, config: RetryBudgetConfig | None = None) -> None:
        super().__init__(config)
        self.counter = counter

    def try_start_retry(self) -> bool:
        started = super().try_start_retry()
        if started:
            self.counter.inc()
        return started


class EjectionCounter:
    """Counts outlier ejections by polling the ejected set (``poll()`` on a ticker).

    An ejection lasts at least the base ejection time (30 s), far longer than the
    poll interval, so none is missed; a child re-ejected within one poll of its
    return would be counted once.
    """

    def __init__(self, ejected_keys: Callable[[], frozenset[str]]) -> None:
        self.ejected_keys = ejected_keys
        self.total = 0
        self._seen: frozenset[str] = frozenset()

    def poll(self) -> None:
        now = self.ejected_keys()
        self.total += len(now - self._seen)
        self._seen = now


def add_local_metrics(
    metrics: TierMetrics,
    depth_by_priority: Callable[[], dict[str, int]],
    ejections: EjectionCounter,
) -> None:
    """The local tier's own families: central queue depth and wait, outlier ejections."""
    tier = metrics.tier
    metrics.queue_wait = Histogram(
        "meridian_queue_wait_seconds",
        "Time a request waited in the local tier's central "
        "queue before it got a GPU slot (0 when one was free).",
        ("tier", "model", "tenant"),
        registry=metrics.registry,
        buckets=LLM_BUCKETS,
    )
    metrics.scraped(
        "meridian_queue_depth",
        "Requests waiting in the local tier's central queue, by priority.",
        ("tier", "priority"),
        lambda: (((tier, p), float(n)) for p, n in depth_by_priority().items()),
    )
    metrics.scraped(
        "meridian_ejections",
        "GPUs ejected by outlier detection since the process started.",
        ("tier",),
        lambda: [((tier,), float(ejections.total))],
        kind="counter",
    )
