"""Process logs: one line per event that matters, as text or as JSON lines.

``configure_logging`` installs one handler on the root logger, writing to stderr
(stdout stays for what a command prints on purpose: ``listening`` lines, reports).
``--log-format json`` writes one JSON object per line with ``timestamp`` (UTC,
ISO-8601, milliseconds), ``level``, ``logger`` and ``message``; ``trace_id`` and
``span_id`` (W3C hex) when the line is written under a recording OpenTelemetry
span; every ``extra={...}`` field of the call as a key of its own; ``exception``
with the traceback when there is one. ``text`` is the classic line, with the
extra fields appended as ``key=value``. Python warnings and uncaught exceptions
go through the same handler, so under ``json`` every line on stderr parses.

Events log at INFO or WARNING with an ``event`` field (``tier_started``,
``child_down``, ``gpu_ejected``, ``sheds`` …); nothing logs per request at INFO.
Shed load is summarised by ``ShedLog``: at most one line per window however many
requests were refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TextIO

import grpc
from opentelemetry import trace

from common.request.call import CallRecord

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT_ENV = "MERIDIAN_LOG_FORMAT"
LEVEL_ENV = "MERIDIAN_LOG_LEVEL"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


@dataclass(frozen=True)
class LogSettings:
    """How a process logs: ``format`` one of FORMATS, ``level`` one of LEVELS."""

    format: str = "text"
    level: str = "info"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"log format {self.format!r}: use one of {', '.join(FORMATS)}")
        if self.level not in LEVELS:
            raise ValueError(f"log level {self.level!r}: use one of {', '.join(LEVELS)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LogSettings:
        """The defaults ``MERIDIAN_LOG_FORMAT`` / ``MERIDIAN_LOG_LEVEL`` give (a bad value:
        ValueError naming the variable)."""
        fmt = env.get(FORMAT_ENV, "text").strip().lower() or "text"
        level = env.get(LEVEL_ENV, "info").strip().lower() or "info"
        if fmt not in FORMATS:
            raise ValueError(f"{FORMAT_ENV}={fmt!r}: use one of {', '.join(FORMATS)}")
        if level not in LEVELS:
            raise ValueError(f"{LEVEL_ENV}={level!r}: use one of {', '.join(LEVELS)}")
        return cls(fmt, level)


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a log call passed as ``extra``."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def span_ids() -> dict[str, str]:
    """``trace_id`` and ``span_id`` of the current span when it records, else nothing."""
    span = trace.get_current_span()
    ctx = span.get_span_context()
    if not span.is_recording() or not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def _iso(created: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{stamp}.{int(created % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "timestamp": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(span_ids())
        for key, value in extra_fields(record).items():
            doc.setdefault(key, value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            doc["stack"] = record.stack_info
        return json.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The classic line, then the extra fields and span ids as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {**extra_fields(record), **span_ids()}
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the first line
        pairs = " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        return f"{head}  {pairs}{sep}{tail}"


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(text) if (" " in text or not text) else text


def configure_logging(settings: LogSettings, stream: TextIO | None = None) -> logging.Handler:
    """Route every logger (and Python warnings, and uncaught exceptions) through one
    handler on ``stream`` (default stderr) at ``settings.level``; returns the handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.level.upper())
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    return handler


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("meridian").critical(
        "uncaught %s: %s", kind.__name__, exc, exc_info=(kind, exc, tb)
    )


# ---------------------------------------------------------------- shed bursts

SHED_WINDOW_S = 10.0


@dataclass
class ShedLog:
    """A CallObserver that logs refused load (RESOURCE_EXHAUSTED) as a summary, never
    per request: the first shed of a quiet spell arms a timer, and when it fires one
    WARNING says how many requests were shed in that window and for which tenants.
    ``flush`` (at stop) writes what the window holds so far."""

    tier: str
    window_s: float = SHED_WINDOW_S
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger(__name__))
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.count = 0
        self.tenants: Counter[str] = Counter()
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def call_started(self, call: CallRecord) -> None:
        return None

    def call_ended(self, call: CallRecord) -> None:
        if call.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            return
        if call.carries_requests and call.requests:  # its requests were counted one by one
            return
        if not self.count:
            self._since = self.clock()
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self.flush)
        self.count += 1
        self.tenants[call.tenant or "-"] += 1

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.count:
            return
        seconds = max(self.clock() - self._since, 0.0)
        self.logger.warning(
            "shed %d requests in the last %.0f s",
            self.count,
            seconds,
            extra={
                "event": "sheds",
                "tier": self.tier,
                "sheds": self.count,
                "window_s": round(seconds, 3),
                "tenants": dict(self.tenants.most_common(10)),
            },
        )
        self.count = 0
        self.tenants.clear()
