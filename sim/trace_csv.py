"""Replay a request trace in the Azure LLM inference trace format as ``SimRequest``.

The file is CSV with a header naming its columns, in any order:
``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens`` (required, as in Azure's
2023 and 2024 files) and ``session``, ``tenant`` (optional); names are
case-sensitive, an unknown one is an error rather than silently ignored.
``TIMESTAMP`` is either a date-time as Azure writes it (``2023-11-16
18:15:46.6805900``, any number of fractional digits, read as UTC) or a plain
number of seconds; every row must use the first row's form. Times are re-based
so that the first request arrives at 0; rows must be in time order, up to
``tolerance_s`` (a row slightly earlier than its predecessor is replayed at the
predecessor's time, as merged logs often are).

Each request is given a city as the synthetic workload does (weight × diurnal
factor of local time, seeded; a date-time trace's first timestamp sets the
hour of day unless ``start_utc_hour`` is given); a session's later turns come
from its first turn's city. Prefix blocks (``sim.sessions.BlockIds``) are fresh
for every prompt except a session's turn whose context is at least the previous
turn's: its blocks extend the previous turn's prompt blocks. A context that
shrank (history cut or reset) shares nothing. A request that generated 0 tokens
is replayed as 1 (the engine always emits a first token), and prompt + output is
capped to ``kv_cap_tokens`` (the smallest GPU's KV cache) as the workload caps it.

Malformed input raises ``TraceError`` naming the file, the line and what to fix.
"""

from __future__ import annotations

import csv
import math
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from common.basics.vocabulary import Priority
from sim.arrivals import Mixer
from sim.caps import DEFAULT_CAPS, CapDraw, ClientCaps
from sim.geography import CITIES, City
from sim.requests import SIM_MODEL, SimRequest
from sim.sessions import BlockIds
from sim.shapes import KV_CAP_TOKENS

REQUIRED = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
OPTIONAL = ("session", "tenant")
DEFAULT_TOLERANCE_S = 1.0
_DATETIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)")
_EXAMPLE = "2023-11-16 18:15:46.6805900"


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class _Columns:
    timestamp: int
    context: int
    generated: int
    session: int | None
    tenant: int | None
    count: int


class _Clock:
    """TIMESTAMP text to seconds, in the form the first row set; date-times count from
    the midnight (UTC) of the first day seen, which keeps sub-microsecond precision
    that seconds since 1970 would lose in a float."""

    def __init__(self, where: str, first: str) -> None:
        self.where = where
        self.dated = _DATETIME.fullmatch(first.strip()) is not None
        self._days: dict[str, float] = {}
        self._epoch: float | None = None

    def seconds(self, text: str, line: int) -> float:
        text = text.strip()
        if self.dated:
            match = _DATETIME.fullmatch(text)
            if match is None:
                raise TraceError(
                    f"{self.where}, line {line}: TIMESTAMP {text!r} is not a date-time like "
                    f"'{_EXAMPLE}' (the form the first row uses)"
                )
            day, hours, minutes, secs = match.groups()
            midnight = self._days.get(day)
            if midnight is None:
                try:
                    midnight = datetime.fromisoformat(day).replace(tzinfo=UTC).timestamp()
                except ValueError:
                    raise TraceError(f"{self.where}, line {line}: no such date {day!r}") from None
                if self._epoch is None:
                    self._epoch = midnight
                midnight -= self._epoch
                self._days[day] = midnight
            return midnight + int(hours) * 3600 + int(minutes) * 60 + float(secs)
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise TraceError(
                f"{self.where}, line {line}: TIMESTAMP {text!r} is neither a date-time like "
                f"'{_EXAMPLE}' nor a number of seconds"
            )
        return value


def _columns(where: str, header: list[str]) -> _Columns:
    names = [h.strip() for h in header]
    known = REQUIRED + OPTIONAL
    for name in names:
        if name not in known:
            raise TraceError(
                f"{where}, line 1: unknown column {name!r}; known: {', '.join(known)} "
                "(names are case-sensitive)"
            )
        if names.count(name) > 1:
            raise TraceError(f"{where}, line 1: column {name!r} appears twice")
    for name in REQUIRED:
        if name not in names:
            raise TraceError(
                f"{where}, line 1: missing column {name!r}; the header must name "
                f"{','.join(REQUIRED)} (and optionally {', '.join(OPTIONAL)})"
            )
    index = {n: i for i, n in enumerate(names)}
    return _Columns(
        index["TIMESTAMP"],
        index["ContextTokens"],
        index["GeneratedTokens"],
        index.get("session"),
        index.get("tenant"),
        len(names),
    )


def _tokens(where: str, line: int, name: str, text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(
            f"{where}, line {line}: {name} must be a whole number of tokens, got {text!r}"
        ) from None
    if value < 0:
        raise TraceError(f"{where}, line {line}: {name} must be >= 0, got {value}")
    return value


def _rows(where: str, handle: IO[str]) -> tuple[_Columns, Iterator[tuple[int, list[str]]]]:
    """The header's columns and the data rows as (line number, fields), blank lines skipped."""
    reader = csv.reader(handle)
    try:
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{where}: empty file; expected a header {','.join(REQUIRED)}")
    except UnicodeDecodeError:
        raise TraceError(f"{where}: not UTF-8 text") from None
    except csv.Error as exc:  # e.g. a field over csv's size limit
        raise TraceError(f"{where}, line 1: {exc}") from None
    columns = _columns(where, header)

    def rows() -> Iterator[tuple[int, list[str]]]:
        try:
            for row in reader:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) != columns.count:
                    raise TraceError(
                        f"{where}, line {reader.line_num}: expected {columns.count} fields "
                        f"({','.join(header)}), got {len(row)}"
                    )
                yield reader.line_num, row
        except UnicodeDecodeError:
            raise TraceError(f"{where}, line {reader.line_num + 1}: not UTF-8 text") from None
        except csv.Error as exc:
            raise TraceError(f"{where}, line {reader.line_num}: {exc}") from None

    return columns, rows()


@dataclass(frozen=True)
class _Options:
    tenant: str
    priorities: Mapping[str, Priority]
    model: str
    kv_cap_tokens: int | None
    tolerance_s: float
    caps: ClientCaps


@dataclass(slots=True)
class _Turn:
    city: int
    prompt_tokens: int
    blocks: tuple[int, ...]


class _Replayer:
    """Turns rows into requests: times re-based, cities drawn, sessions' blocks extended."""

    def __init__(
        self, where: str, columns: _Columns, clock: _Clock, mixer: Mixer, seed: int, opts: _Options
    ) -> None:
        self.where, self.columns, self.clock, self.mixer, self.opts = (
            where,
            columns,
            clock,
            mixer,
            opts,
        )
        self.rng = random.Random(f"trace:{seed}")
        self.ids = BlockIds(self.rng)
        self.caps = CapDraw(opts.caps, random.Random(f"caps:{seed}"))
        self.sessions: dict[str, _Turn] = {}
        self.base: float | None = None
        self.last = 0.0
        self.last_line = 0

    def _time(self, line: int, text: str) -> float:
        absolute = self.clock.seconds(text, line)
        if self.base is None:
            self.base = absolute
        t = absolute - self.base
        if not math.isfinite(t):  # -1e308 then 1e308: each finite, 2e308 apart
            raise TraceError(
                f"{self.where}, line {line}: TIMESTAMP {text.strip()[:32]!r} is too far from "
                "the first row's to be replayed (a float cannot count the seconds between)"
            )
        if t < self.last - self.opts.tolerance_s:
            raise TraceError(
                f"{self.where}, line {line}: TIMESTAMP goes back {self.last - t:.3f} s from "
                f"line {self.last_line}; rows must be in time order (within "
                f"{self.opts.tolerance_s:g} s)"
            )
        self.last, self.last_line = max(t, self.last), line
        return self.last

    def _city(self, t: float) -> int:
        if t >= self.mixer.until:
            self.mixer.set_time(t)
        return self.mixer.pick(self.rng.random())[0]

    def _shape(self, line: int, row: list[str]) -> tuple[int, int]:
        cols, cap = self.columns, self.opts.kv_cap_tokens
        prompt = _tokens(self.where, line, "ContextTokens", row[cols.context])
        output = max(1, _tokens(self.where, line, "GeneratedTokens", row[cols.generated]))
        if cap is not None:
            output = min(output, cap - 1)
            prompt = min(prompt, cap - output)
        return prompt, output

    def request(self, n: int, line: int, row: list[str]) -> SimRequest:
        cols, opts = self.columns, self.opts
        t = self._time(line, row[cols.timestamp])
        prompt, true_output = self._shape(line, row)
        max_tokens, output = self.caps.draw(prompt, true_output)
        session = row[cols.session].strip() if cols.session is not None else ""
        tenant = row[cols.tenant].strip() if cols.tenant is not None else ""
        tenant = tenant or opts.tenant
        previous = self.sessions.get(session) if session else None
        shared: tuple[int, ...] = ()
        if previous is None:
            city, blocks = self._city(t), self.ids.extend((), prompt)
        else:
            city = previous.city
            shared = previous.blocks if prompt >= previous.prompt_tokens else ()
            blocks = self.ids.extend(shared, prompt)
        if session:
            self.sessions[session] = _Turn(city, prompt, blocks)
        where = self.mixer.cities[city]
        return SimRequest(
            n,
            t,
            where.name,
            where.location,
            tenant,
            prompt,
            output,
            blocks,
            session or None,
            opts.priorities.get(tenant, Priority.STANDARD),
            opts.model,
            max_tokens=max_tokens,
            shared_blocks=len(shared),
        )


def _replay(
    handle: IO[str],
    replayer: _Replayer,
    first: tuple[int, list[str]],
    rows: Iterator[tuple[int, list[str]]],
) -> Iterator[SimRequest]:
    try:
        yield replayer.request(0, *first)
        for n, (line, row) in enumerate(rows, start=1):
            yield replayer.request(n, line, row)
    finally:
        handle.close()


def read_trace(
    path: str | Path,
    *,
    seed: int = 0,
    cities: tuple[City, ...] = CITIES,
    diurnal: bool = True,
    start_utc_hour: float | None = None,
    day_length_s: float = 86_400.0,
    tenant: str = "trace",
    priorities: Mapping[str, Priority] | None = None,
    model: str = SIM_MODEL,
    kv_cap_tokens: int | None = KV_CAP_TOKENS,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    caps: ClientCaps = DEFAULT_CAPS,
) -> Iterator[SimRequest]:
    """The trace's requests, lazily, ids 0..n-1 in file order (see the module docstring).

    The header and the first row are read at once, so an empty or headless file
    fails here; a later malformed row fails when the iteration reaches it.
    ``caps`` is how the trace's clients set ``max_tokens`` (the trace records only the
    length generated; ``sim.caps``). ``priorities`` maps a tenant to the priority its
    requests carry (standard otherwise).
    """
    if not cities:
        raise ValueError("read_trace: cities must list at least one city")
    if not (tolerance_s >= 0 and day_length_s > 0):
        raise ValueError(
            f"read_trace: need tolerance_s >= 0 and day_length_s > 0, "
            f"got {tolerance_s} and {day_length_s}"
        )
    where = str(path)
    try:
        handle = Path(path).open(encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise TraceError(f"{where}: cannot read it: {exc.strerror}") from None
    try:
        columns, rows = _rows(where, handle)
        first = next(rows, None)
        if first is None:
            raise TraceError(f"{where}: empty file: no requests after the header")
        clock = _Clock(where, first[1][columns.timestamp])
        if start_utc_hour is None:
            start = clock.seconds(first[1][columns.timestamp], first[0]) if clock.dated else 0.0
            start_utc_hour = (start % 86_400.0) / 3600.0
    except BaseException:
        handle.close()
        raise
    mixer = Mixer(
        cities,
        [(tenant, 1.0)],
        diurnal=diurnal,
        start_utc_hour=start_utc_hour,
        day_length_s=day_length_s,
    )
    mixer.set_time(0.0)
    opts = _Options(tenant, dict(priorities or {}), model, kv_cap_tokens, tolerance_s, caps)
    replayer = _Replayer(where, columns, clock, mixer, seed, opts)
    return _replay(handle, replayer, first, rows)
