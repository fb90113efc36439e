"""Reading usage back: totals per (tenant, model) over a window, each record counted once."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

from common.basics.redis_url import async_redis
from common.tenancy.usage_record import OK_STATUS, USAGE_STREAM, UsageRecord, field_text

log = logging.getLogger(__name__)


@dataclasses.dataclass
class UsageTotals:
    """Sums for one (tenant, model); ``statuses`` counts requests per gRPC status name;
    ``estimated``: requests whose token counts are the edge's estimates (the GPU server
    reported none; ``UsageRecord.tokens_reported`` False)."""

    requests: int = 0
    ok_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    statuses: dict[str, int] = dataclasses.field(default_factory=dict)
    estimated: int = 0

    def add(self, rec: UsageRecord) -> None:
        self.requests += 1
        self.ok_requests += rec.status == OK_STATUS
        self.estimated += not rec.tokens_reported
        self.prompt_tokens += rec.prompt_tokens
        self.completion_tokens += rec.completion_tokens
        self.gpu_seconds += rec.gpu_seconds
        self.statuses[rec.status] = self.statuses.get(rec.status, 0) + 1

    def merge(self, other: UsageTotals) -> None:
        self.requests += other.requests
        self.ok_requests += other.ok_requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.gpu_seconds += other.gpu_seconds
        self.estimated += other.estimated
        for status, n in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + n


async def summarise(
    redis_url: str,
    *,
    since_ms: int | None,
    until_ms: int | None,
    stream: str = USAGE_STREAM,
    chunk: int = 1000,
    clock_skew_ms: int = 300_000,
    dedup_horizon_ms: int = 3_600_000,
) -> dict[tuple[str, str], UsageTotals]:
    """Totals per (tenant, model) of records with ``since_ms <= finished_at_ms < until_ms``.

    Reads with XRANGE ``chunk`` entries at a time. A record is written after it
    finished, so the scan starts at ``since_ms - clock_skew_ms`` (an edge clock
    ahead of Redis's) and runs to the end of the stream (a record buffered
    through an outage lands late). A ``request_id`` is remembered until the
    scan has moved ``dedup_horizon_ms`` of stream time past it: duplicates come
    from re-written batches and lie close together, so memory stays bounded by
    the records of one horizon, not of the whole window.
    """
    client = async_redis(redis_url, socket_timeout=5.0, socket_connect_timeout=2.0)
    totals: dict[tuple[str, str], UsageTotals] = {}
    seen: set[str] = set()
    recent: deque[tuple[int, str]] = deque()  # (stream ms, request_id), oldest first
    malformed = 0
    start = "-" if since_ms is None else f"{max(0, since_ms - clock_skew_ms)}-0"
    try:
        while True:
            entries: Any = await client.xrange(stream, min=start, max="+", count=chunk)
            for entry_id, fields in entries:
                stream_ms = int(field_text(entry_id).split("-", 1)[0])
                while recent and recent[0][0] < stream_ms - dedup_horizon_ms:
                    seen.discard(recent.popleft()[1])
                try:
                    rec = UsageRecord.from_fields(fields)
                except ValueError:
                    malformed += 1
                    continue
                if since_ms is not None and rec.finished_at_ms < since_ms:
                    continue
                if until_ms is not None and rec.finished_at_ms >= until_ms:
                    continue
                if rec.request_id in seen:
                    continue
                seen.add(rec.request_id)
                recent.append((stream_ms, rec.request_id))
                totals.setdefault((rec.tenant, rec.model), UsageTotals()).add(rec)
            if len(entries) < chunk:
                break
            ms, seq = field_text(entries[-1][0]).split("-", 1)
            start = f"{ms}-{int(seq) + 1}"
    finally:
        await client.aclose()
    if malformed:
        log.warning("skipped %d malformed usage records in %s", malformed, stream)
    return totals
