"""The newest finished spans of one process, kept in memory for ``/api/traces``."""

from __future__ import annotations

import threading
from collections import deque

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

RECENT_SPANS = 2000


class RecentSpans(SpanProcessor):
    """The newest ``capacity`` finished spans, oldest dropped first.

    ``on_end`` runs on the request path, so it only appends to a bounded deque
    (O(1), no export work); grouping happens when someone reads ``traces()``.
    """

    def __init__(self, capacity: int = RECENT_SPANS) -> None:
        self._spans: deque[ReadableSpan] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self._spans.append(span)

    def spans(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    def traces(self) -> dict[str, list[ReadableSpan]]:
        """Spans grouped by hex trace id, each trace's spans in start order."""
        grouped: dict[str, list[ReadableSpan]] = {}
        for span in self.spans():
            ctx = span.get_span_context()
            if ctx is None:
                continue
            grouped.setdefault(format(ctx.trace_id, "032x"), []).append(span)
        for spans in grouped.values():
            spans.sort(key=lambda s: s.start_time or 0)
        return grouped

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
