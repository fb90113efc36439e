"""``meridian usage``: sum the usage records per tenant and model for a time window.

Besides the totals it says when they may be short: the stream was trimmed
(``MAXLEN``) past the window's start, reset (Redis lost its data), or
begins after the window does (``common.tenancy.usage_state``). Those go to
stderr after the table, and into ``warnings`` (with ``complete: false``)
in ``--json``; the exit code stays 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import RedisError

from cli.options import HelpFormatter
from common.basics.redis_url import redact
from common.config.node import ConfigError
from common.operations.redis_acl import USAGE
from common.operations.redis_login import RedisLogin, read_password
from common.tenancy.usage import USAGE_STREAM, UsageTotals, summarise
from common.tenancy.usage_state import StreamState, stream_state

_RELATIVE = re.compile(r"^(\d+)([smhdw])$")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_time(text: str, now_ms: int) -> int:
    """``now``, a relative age (``30m``, ``1h``, ``7d``) or ISO-8601 (UTC when no offset)
    → epoch milliseconds; ``ValueError`` saying what is accepted."""
    text = text.strip()
    if text == "now":
        return now_ms
    if match := _RELATIVE.match(text):
        return now_ms - int(match[1]) * _UNIT_MS[match[2]]
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"bad time {text!r}: use ISO-8601 (2025-01-31T12:00:00Z), a relative age "
            "(30s, 30m, 1h, 7d, 2w) or 'now'"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def _iso(ms: int) -> str:
    return (
        datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    )


# estimated: requests whose token counts are estimates (the GPU server reported none).
_COLUMNS = "tenant model requests ok prompt_tokens completion_tokens estimated gpu_seconds".split()


def _cells(tenant: str, model: str, t: UsageTotals) -> list[str]:
    counts = (t.requests, t.ok_requests, t.prompt_tokens, t.completion_tokens, t.estimated)
    return [tenant, model, *map(str, counts), f"{t.gpu_seconds:.3f}"]


def format_table(totals: Mapping[tuple[str, str], UsageTotals]) -> str:
    """A fixed-width table, one row per (tenant, model) in sorted order, then a total row."""
    grand = UsageTotals()
    for part in totals.values():
        grand.merge(part)
    rows = [_cells(tenant, model, t) for (tenant, model), t in sorted(totals.items())]
    rows.append(_cells("total", "", grand))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    lines = []
    for row in [_COLUMNS, *rows]:
        cells = [
            v.ljust(w) if i < 2 else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def totals_json(totals: Mapping[tuple[str, str], UsageTotals]) -> list[dict[str, Any]]:
    return [
        {
            "tenant": tenant,
            "model": model,
            **dataclasses.asdict(t),
            "gpu_seconds": round(t.gpu_seconds, 6),
            "statuses": dict(sorted(t.statuses.items())),
        }
        for (tenant, model), t in sorted(totals.items())
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meridian usage",
        description="Usage records summed per tenant and model over a time window.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--redis", required=True, metavar="URL", help="redis URL, e.g. redis://127.0.0.1:6379/0"
    )
    parser.add_argument(
        "--since", default="24h", metavar="TIME", help="ISO-8601 or relative (30m, 1h, 7d)"
    )
    parser.add_argument("--until", default="now", metavar="TIME", help="ISO-8601 or relative")
    parser.add_argument("--stream", default=USAGE_STREAM, metavar="KEY", help="the usage stream")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--redis-password-file",
        metavar="FILE",
        help="log in as the read-only ACL user --redis-user with the password in FILE; "
        "also $MERIDIAN_REDIS_PASSWORD_FILE or $MERIDIAN_REDIS_PASSWORD",
    )
    parser.add_argument(
        "--redis-user", default=USAGE, metavar="NAME", help="ACL user, with a password"
    )
    return parser


def usage_main(argv: list[str] | None = None, *, now_ms: int | None = None) -> int:
    """``meridian usage``: totals per tenant and model over a time window; exit code 2 on
    a bad argument or an unreachable Redis. ``now_ms`` pins the clock for tests."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed why
        return 0 if exc.code == 0 else 2
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    try:
        since, until = parse_time(args.since, now), parse_time(args.until, now)
    except ValueError as exc:
        print(f"meridian usage: {exc}", file=sys.stderr)
        return 2
    if since >= until:
        print(
            f"meridian usage: --since ({_iso(since)}) is not before --until ({_iso(until)})",
            file=sys.stderr,
        )
        return 2
    try:
        password = read_password(args.redis_password_file, os.environ)
    except ConfigError as exc:
        print(f"meridian usage: {exc}", file=sys.stderr)
        return 2
    url = RedisLogin(args.redis_user, password).url(args.redis)
    try:
        totals, state = asyncio.run(_read(url, since, until, args.stream))
    except (RedisError, OSError) as exc:
        where = redact(args.redis)
        print(f"meridian usage: cannot read {args.stream} from {where}: {exc}", file=sys.stderr)
        return 2
    warnings = state.warnings(since)
    if args.json:
        window = {"since": _iso(since), "until": _iso(until), "since_ms": since, "until_ms": until}
        doc = {**window, "stream": args.stream, "totals": totals_json(totals)}
        doc.update(complete=not warnings, warnings=warnings, stream_state=state.as_json())
        print(json.dumps(doc, indent=2))
    else:
        print(f"usage {_iso(since)} .. {_iso(until)} (stream {args.stream})")
        print(format_table(totals))
        for warning in warnings:
            print(f"meridian usage: warning: {warning}", file=sys.stderr)
    return 0


async def _read(
    url: str, since: int, until: int, stream: str
) -> tuple[dict[tuple[str, str], UsageTotals], StreamState]:
    # The state first: a record trimmed or reset away after it was read is still
    # counted; one lost before is what the state warns of.
    state = await stream_state(url, stream)
    return await summarise(url, since_ms=since, until_ms=until, stream=stream), state
