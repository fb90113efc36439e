"""A small, dependency-free metrics registry rendering Prometheus text exposition 0.0.4.

``Registry`` holds ``Counter``, ``Gauge`` and ``Histogram`` families, each with a
fixed tuple of label names. ``family.labels(*values)`` returns the child for one
label tuple (a dict lookup; created on first use), and an observation on a child is
O(1): a float add, or for a histogram a bisect over the bucket bounds plus two adds.
Buckets are stored non-cumulatively and summed at render time, so observing never
touches more than one bucket. A ``CallbackGauge`` reads its samples at scrape time
(queue depth, ejections, child health), so nothing has to be pushed on change.

Label cardinality is the caller's duty: every label value used here comes from a
bounded set (tiers, configured models and tenants, status codes, children).
The registry is an object a tier owns and passes explicitly; there is no global
default registry.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from a cached short answer (~5 ms) to a long generation (minutes).
LLM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

Sample = tuple[str, tuple[tuple[str, str], ...], float]


def escape_label(value: str) -> str:
    """Escape a label value as the exposition format asks: backslash, quote, newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels_text(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs)
    return f"{{{inner}}}" if inner else ""


class _Family:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def samples(self) -> Iterator[Sample]:
        raise NotImplementedError

    def render(self) -> Iterator[str]:
        help_text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        yield f"# HELP {self.name} {help_text}"
        yield f"# TYPE {self.name} {self.kind}"
        for name, pairs, value in self.samples():
            yield f"{name}{_labels_text(pairs)} {format_value(value)}"

    def _check(self, values: tuple[str, ...]) -> None:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class CounterChild(_Value):
    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class GaugeChild(_Value):
    __slots__ = ()

    def set(self, value: float) -> None:
        self.value = value

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _ValueFamily(_Family):
    child_type: type[_Value] = _Value

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._children: dict[tuple[str, ...], _Value] = {}

    def _child(self, values: tuple[str, ...]) -> _Value:
        child = self._children.get(values)
        if child is None:
            self._check(values)
            child = self._children[values] = self.child_type()
        return child

    def items(self) -> list[tuple[tuple[str, ...], _Value]]:
        """Each label tuple and its child, for readers inside the process."""
        return list(self._children.items())

    def samples(self) -> Iterator[Sample]:
        for values, child in list(self._children.items()):
            yield self.name, tuple(zip(self.labelnames, values, strict=True)), child.value


class Counter(_ValueFamily):
    kind = "counter"
    child_type = CounterChild

    def labels(self, *values: str) -> CounterChild:
        child = self._child(values)
        assert isinstance(child, CounterChild)
        return child


class Gauge(_ValueFamily):
    kind = "gauge"
    child_type = GaugeChild

    def labels(self, *values: str) -> GaugeChild:
        child = self._child(values)
        assert isinstance(child, GaugeChild)
        return child


class CallbackGauge(_Family):
    """A gauge whose samples ``read()`` returns at scrape time: (label values, value)."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str],
        read: Callable[[], Iterable[tuple[tuple[str, ...], float]]],
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.read = read

    def samples(self) -> Iterator[Sample]:
        for values, value in self.read():
            self._check(values)
            yield self.name, tuple(zip(self.labelnames, values, strict=True)), value


class CallbackCounter(CallbackGauge):
    """A counter kept elsewhere (a running total), read at scrape time."""

    kind = "counter"


class HistogramChild:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class Histogram(_Family):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LLM_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        if "le" in self.labelnames:
            raise ValueError(f"{name}: 'le' is reserved for buckets")
        bounds = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        if not bounds:
            raise ValueError(f"{name}: at least one finite bucket is needed")
        self.bounds = bounds
        self._children: dict[tuple[str, ...], HistogramChild] = {}

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            self._check(values)
            child = self._children[values] = HistogramChild(self.bounds)
        return child

    def items(self) -> list[tuple[tuple[str, ...], HistogramChild]]:
        """Each label tuple and its child, for readers inside the process."""
        return list(self._children.items())

    def samples(self) -> Iterator[Sample]:
        for values, child in list(self._children.items()):
            pairs = tuple(zip(self.labelnames, values, strict=True))
            running = 0
            for bound, count in zip((*self.bounds, math.inf), child.counts, strict=True):
                running += count
                le = "+Inf" if math.isinf(bound) else format_value(bound)
                yield f"{self.name}_bucket", (*pairs, ("le", le)), float(running)
            yield f"{self.name}_sum", pairs, child.sum
            yield f"{self.name}_count", pairs, float(child.count)


class Registry:
    """The metric families of one process, rendered in registration order."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def register(self, family: _Family) -> None:
        if family.name in self._families:
            raise ValueError(f"metric {family.name!r} registered twice")
        self._families[family.name] = family

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        family = Counter(name, help_text, labelnames)
        self.register(family)
        return family

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        family = Gauge(name, help_text, labelnames)
        self.register(family)
        return family

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LLM_BUCKETS,
    ) -> Histogram:
        family = Histogram(name, help_text, labelnames, buckets)
        self.register(family)
        return family

    def render(self) -> str:
        lines: list[str] = []
        for family in self._families.values():
            lines.extend(family.render())
        return "\n".join(lines) + "\n"
