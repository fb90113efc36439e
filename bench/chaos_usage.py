"""Usage records against what was served: lost, doubled and erased records.

The edge writes one record per finished request to the Redis stream ``meridian:{usage}``
(``common.tenancy.usage``), carrying the call's trace id, which the bench chose
(``chaos_load.traceparent``). A snapshot reads the whole stream (XRANGE in chunks); a check
matches it call by call:

* **lost**: a request the caller was served that has no ``OK`` record;
* **doubled**: records beyond one per request (distinct ``request_id`` values: the copies a
  re-written batch leaves, same ``request_id``, are what ``meridian usage`` already drops and
  are counted apart as ``rewritten``);
* **phantom**: an ``OK`` record for a call the caller saw fail, or (in a stream of many
  requests) beyond the requests served: billed, not served;
* **erased**: records the previous snapshot held that this one does not (history lost, as
  when a Redis without persistence restarts).

A stream of many requests should leave one record per request; for it, lost and doubled
compare the ``OK`` records with the requests served, and tokens billed with tokens served.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from bench.chaos_load import Shot
from common.tenancy.usage import USAGE_STREAM


@dataclass(frozen=True, slots=True)
class Rec:
    request_id: str
    status: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class UsageSnapshot:
    """The usage stream at ``taken_at`` (monotonic), by trace id."""

    taken_at: float
    entries: int = 0
    # Entries repeating a request_id already seen, by trace id.
    rewritten: Counter[str] = field(default_factory=Counter)
    by_trace: dict[str, list[Rec]] = field(default_factory=dict)
    request_ids: set[str] = field(default_factory=set)
    error: str = ""


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def read_usage(url: str, *, stream: str = USAGE_STREAM, chunk: int = 5000) -> UsageSnapshot:
    """Read the whole stream now (blocking: run it in a thread); retries for 10 s."""
    deadline = time.monotonic() + 10.0
    while True:
        snap = UsageSnapshot(time.monotonic())
        try:
            _read_into(snap, url, stream, chunk)
            return snap
        except redis.RedisError as exc:
            if time.monotonic() > deadline:
                snap.error = f"{type(exc).__name__}: {exc}"
                return snap
            time.sleep(0.5)


def _read_into(snap: UsageSnapshot, url: str, stream: str, chunk: int) -> None:
    client = redis.Redis.from_url(url, socket_timeout=5.0, decode_responses=True)
    try:
        start = "-"
        while True:
            entries: Any = client.xrange(stream, min=start, max="+", count=chunk)
            for _, fields in entries:
                snap.entries += 1
                rid = fields.get("request_id", "")
                if rid in snap.request_ids:
                    snap.rewritten[fields.get("trace_id", "")] += 1
                    continue
                snap.request_ids.add(rid)
                rec = Rec(
                    rid,
                    fields.get("status", ""),
                    _int(fields.get("prompt_tokens")),
                    _int(fields.get("completion_tokens")),
                )
                snap.by_trace.setdefault(fields.get("trace_id", ""), []).append(rec)
            if len(entries) < chunk:
                return
            start = f"({entries[-1][0]}"
    finally:
        client.close()


@dataclass
class UsageCheck:
    """How the records of some calls compare with what their callers saw."""

    calls: int = 0
    served: int = 0  # requests served
    billed: int = 0  # OK records for them
    lost: int = 0
    doubled: int = 0
    phantom: int = 0
    unserved_unrecorded: int = 0  # failed or refused calls without a record (each has one)
    tokens_served: int = 0
    tokens_billed: int = 0
    erased: int = 0
    rewritten: int = 0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_usage(
    shots: Iterable[Shot], snap: UsageSnapshot, previous: UsageSnapshot | None = None
) -> UsageCheck:
    """Match ``shots`` against ``snap``; ``previous`` gives the records erased since."""
    out = UsageCheck(error=snap.error)
    for shot in shots:
        recs = snap.by_trace.get(shot.trace_id, [])
        out.rewritten += snap.rewritten[shot.trace_id]
        ok = [r for r in recs if r.status == "OK"]
        out.calls += 1
        out.served += shot.served
        out.billed += len(ok)
        out.tokens_served += shot.tokens
        out.tokens_billed += sum(r.completion_tokens for r in ok)
        if shot.requests > 1:  # one record per request is the goal
            out.lost += max(0, shot.served - len(ok))
            out.phantom += max(0, len(ok) - shot.served)
            continue
        if shot.served and not ok:
            out.lost += 1
        if not shot.served and ok:
            out.phantom += len(ok)
        if not recs and not shot.served:
            out.unserved_unrecorded += 1
        out.doubled += max(0, len(recs) - 1)
    if previous is not None and not previous.error and not snap.error:
        out.erased = len(previous.request_ids - snap.request_ids)
    return out
