"""``meridian top``: the fleet in a terminal, redrawn every second.

It reads what the dashboard reads from the global tier's ops HTTP
(``/api/fleet`` and ``/api/series``, see ``common.operations.fleet_view``) and draws one
table: regions → zones → GPUs with health, a utilisation bar, requests in flight
over slots, what each GPU reports running and waiting, KV-cache use and the local
tier's queue; above it the fleet's request rate, latency and a sparkline of the
last minute. ``--once`` prints one frame without clearing the screen (for scripts
and tests). Colours only on a terminal, and never with ``--no-color`` or
``NO_COLOR`` set. Lines are cut to the terminal's width (``COLUMNS`` when set,
else the terminal's own; piped without ``COLUMNS``: not cut). Piped, frames are
written one after another, separated by a blank line, with no escape sequence
that moves the cursor or clears the screen.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

DESCRIPTION = """The fleet in a terminal, redrawn every --interval seconds from the global tier's
ops HTTP: regions, zones and GPUs with health, load and queues. Colours only on a
terminal (never with --no-color or NO_COLOR); lines cut to COLUMNS, else to the
terminal's width; piped, plain frames one after another (no screen clearing). With
auth on, the operator key `meridian up` prints goes in MERIDIAN_OPERATOR_KEY."""
OPERATOR_KEY_ENV = "MERIDIAN_OPERATOR_KEY"
SPARKS = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 10
NOTE_WIDTH = 60
RESET, BOLD, DIM = "\x1b[0m", "\x1b[1m", "\x1b[2m"
GREEN, YELLOW, RED, MAGENTA, BLUE = "\x1b[32m", "\x1b[33m", "\x1b[31m", "\x1b[35m", "\x1b[34m"
STATE_COLOUR = {"ok": GREEN, "down": RED, "ejected": MAGENTA, "drained": BLUE, "unknown": DIM}
# C0 and C1 control characters and DEL: what a GPU worker or a stray reply could use to
# move the cursor, recolour or clear the operator's terminal.
_CONTROLS = dict.fromkeys([*range(0x20), *range(0x7F, 0xA0)])


def clean(text: object) -> str:
    """``text`` as printable characters only: control characters dropped.

    Errors and names that other processes report (a GPU's ``last_error``, an
    unreachable tier's reason, a reply that is not HTTP) are printed as they
    are only after this."""
    return str(text).translate(_CONTROLS)


class Paint:
    """ANSI colour when ``on``, plain text otherwise."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self, text: str, *codes: str) -> str:
        return f"{''.join(codes)}{text}{RESET}" if self.on and codes else text


def util_colour(utilisation: float) -> str:
    return GREEN if utilisation < 0.5 else YELLOW if utilisation < 0.85 else RED


def bar(utilisation: float | None, paint: Paint) -> str:
    """``██████░░░░  60%``; blank when utilisation is unknown."""
    if utilisation is None:
        return " " * (BAR_WIDTH + 6)
    u = max(0.0, min(1.0, utilisation))
    filled = round(u * BAR_WIDTH)
    body = paint("█" * filled, util_colour(u)) + paint("░" * (BAR_WIDTH - filled), DIM)
    return f"{body} {round(u * 100):>3}% "


def sparkline(values: Sequence[float]) -> str:
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1)))] for v in values)


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{float(value):.{digits}f}"


def _mean(points: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [p[key] for p in points if p.get(key) is not None]
    return sum(values) / len(values) if values else None


def _health(healthy: Any, reachable: Any, paint: Paint, drained: Any = False) -> str:
    if reachable is False:
        return paint("unreachable", RED)
    if drained and healthy:
        return paint("drained", BLUE)
    if healthy is None:
        return paint("?", DIM)
    return paint("up", GREEN) if healthy else paint("down", RED)


# Table columns: key, width, alignment.
COLUMNS = (
    ("name", 26, "<"),
    ("hw", 5, "<"),
    ("state", 11, "<"),
    ("bar", 16, "<"),
    ("flight", 9, ">"),
    ("run", 5, ">"),
    ("wait", 5, ">"),
    ("kv", 5, ">"),
)


def visible(text: str) -> str:
    """``text`` without its ANSI escape sequences (what the terminal shows)."""
    out, skip = [], False
    for ch in text:
        if ch == "\x1b":
            skip = True
        elif skip and ch == "m":
            skip = False
        elif not skip:
            out.append(ch)
    return "".join(out)


def row(cells: Mapping[str, str], note: str = "") -> str:
    """One table line; cells are padded by their visible width, not their length.

    ``note`` is reported text: it is cleaned of control characters and cut to 60."""
    parts = []
    for key, width, align in COLUMNS:
        text = cells.get(key, "")
        gap = " " * max(0, width - len(visible(text)))
        parts.append(text + gap if align == "<" else gap + text)
    return (" ".join(parts) + "  " + clean(note)[:NOTE_WIDTH]).rstrip()


def render(
    fleet: Mapping[str, Any] | None,
    series: Mapping[str, Any] | None,
    *,
    source: str,
    paint: Paint,
    error: str = "",
) -> str:
    """One frame of ``meridian top`` as text."""
    now = time.strftime("%H:%M:%S")
    lines = [paint(f"Meridian top — {source}   {now}", BOLD)]
    if error:
        lines.append(paint(f"no answer: {clean(error)}", RED))
    if fleet is None:
        return "\n".join(lines) + "\n"
    points = list((series or {}).get("points") or [])
    recent = points[-5:]
    totals = fleet.get("totals", {})
    lines.append(
        f"requests/s {_num(_mean(recent, 'rps'), 1)}   "
        f"p50 {_num(_mean(recent, 'p50_ms'))} ms   p99 {_num(_mean(recent, 'p99_ms'))} ms   "
        f"failed/s {_num(_mean(recent, 'errors_per_s'), 1)}   "
        f"GPUs {totals.get('gpus_ok', 0)}/{totals.get('gpus', 0)} serving   "
        f"slots busy {round(100 * totals.get('utilisation', 0.0))}%   "
        f"queued {totals.get('queued', 0)}"
    )
    lines.append(f"last minute  {paint(sparkline([p['rps'] for p in points[-60:]]), BLUE)}")
    lines.append("")
    header = {"name": "REGION / ZONE / GPU", "hw": "HW", "state": "STATE", "bar": "BUSY"}
    header.update(flight="IN FLIGHT", run="RUN", wait="WAIT", kv="KV")
    lines.append(paint(row(header), BOLD))
    for region in fleet.get("regions", ()):
        cells = {
            "name": paint(region["name"], BOLD),
            "state": _health(
                region.get("healthy"), region.get("reachable"), paint, region.get("drained")
            ),
            "bar": bar(region.get("utilisation"), paint),
            "flight": _num(region.get("outstanding")),
        }
        lines.append(row(cells, region.get("error") or region.get("last_error") or ""))
        for zone in region.get("zones", ()):
            queue = zone.get("tier_queued")
            cells = {
                "name": f"  {zone['name']}",
                "state": _health(
                    zone.get("healthy"), zone.get("reachable"), paint, zone.get("drained")
                ),
                "bar": bar(zone.get("utilisation"), paint),
                "flight": _num(zone.get("outstanding")),
            }
            note = zone.get("error") or ("" if queue is None else f"tier queue {queue}")
            lines.append(row(cells, note))
            for gpu in zone.get("gpus", ()):
                lines.append(_gpu_row(gpu, paint))
    return "\n".join(lines) + "\n"


def _gpu_row(gpu: Mapping[str, Any], paint: Paint) -> str:
    state = gpu.get("state", "unknown")
    kv = gpu.get("kv_cache_usage")
    note = gpu.get("last_error") or ""
    if gpu.get("weight", 1.0) != 1.0:  # set by the admin API; 1.0 is the default
        note = f"weight {gpu['weight']} {note}".strip()
    cells = {
        "name": f"    {gpu['name']}",
        "hw": clean(gpu.get("hardware", "")),
        "state": paint(state, STATE_COLOUR.get(state, "")),
        "bar": bar(gpu.get("utilisation"), paint),
        "flight": f"{gpu['outstanding']}/{gpu['slots']}" if "outstanding" in gpu else "–",
        "run": _num(gpu.get("running")),
        "wait": _num(gpu.get("waiting")),
        "kv": "–" if kv is None else f"{round(kv * 100)}%",
    }
    return row(cells, note)


def fetch(base: str, path: str, timeout_s: float, key: str | None = None) -> dict[str, Any]:
    """The JSON object at ``base + path`` (asked with operator ``key`` as a bearer when
    given); ValueError when the answer is not one."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    request = urllib.request.Request(f"{base}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        body = json.loads(reply.read())
    if not isinstance(body, dict):
        raise ValueError(f"{path} answered {type(body).__name__}, not an object")
    return body


def frame(
    base: str, paint: Paint, timeout_s: float = 2.0, key: str | None = None
) -> tuple[str, bool]:
    """One frame from the global at ``base``; and whether it answered.

    Whatever is at ``base`` (nothing, a gRPC port, a server that hangs up halfway)
    makes a "no answer" frame, never a traceback."""
    try:
        fleet = fetch(base, "/api/fleet", timeout_s, key)
        series = fetch(base, "/api/series?seconds=60", timeout_s, key)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        text = f"{type(exc).__name__}: {reason}" if str(reason) else type(exc).__name__
        return render(None, None, source=base, paint=paint, error=text), False
    return render(fleet, series, source=base, paint=paint), True


def width_of(out: TextIO, env: Mapping[str, str]) -> int | None:
    """Columns to fit: ``COLUMNS`` when set, else the terminal's; None (no limit) when
    ``out`` is not a terminal."""
    columns = env.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return shutil.get_terminal_size().columns if out.isatty() else None


def fit(text: str, width: int | None) -> str:
    """Every line of ``text`` cut to ``width`` visible characters (escapes kept, and a
    reset after a cut line that had any)."""
    if width is None:
        return text
    out = []
    for line in text.split("\n"):
        kept, shown, escape, cut = [], 0, False, False
        for ch in line:
            if ch == "\x1b":
                escape = True
            if not escape:
                if shown == width:
                    cut = True
                    break
                shown += 1
            elif ch == "m":
                escape = False
            kept.append(ch)
        text_line = "".join(kept)
        out.append(text_line + RESET if cut and "\x1b" in text_line else text_line)
    return "\n".join(out)


def top_main(args: argparse.Namespace) -> int:
    base = args.ops.rstrip("/")
    if "://" not in base:
        base = f"http://{base}"
    out = sys.stdout
    terminal = out.isatty()
    paint = Paint(terminal and not args.no_color and not os.environ.get("NO_COLOR"))
    # The operator key for /api/* when the fleet runs with auth on (an environment
    # variable, not an option: a command line is visible to every user of the machine).
    key = os.environ.get(OPERATOR_KEY_ENV) or None
    if args.once:
        text, answered = frame(base, paint, key=key)
        out.write(fit(text, width_of(out, os.environ)))
        return 0 if answered else 1
    if terminal:
        out.write("\x1b[?25l")  # hide the cursor while redrawing
    drawn = 0
    try:
        while args.count is None or drawn < args.count:
            if drawn:
                time.sleep(args.interval)
            text, _ = frame(base, paint, key=key)
            text = fit(text, width_of(out, os.environ))  # the terminal may have been resized
            # A terminal gets the frame redrawn in place; a pipe gets frames in sequence.
            out.write("\x1b[H\x1b[2J" + text if terminal else ("\n" if drawn else "") + text)
            out.flush()
            drawn += 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if terminal:
            out.write("\x1b[?25h")
            out.flush()


def add_parser(sub: Any) -> None:
    """``meridian top`` and its options (``sub``: the CLI's subparsers)."""
    from cli.options import HelpFormatter, positive_float, positive_int

    top = sub.add_parser(
        "top",
        help="live terminal view of the fleet",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    top.add_argument(
        "--ops",
        default="http://127.0.0.1:8002",
        metavar="URL",
        help="the global tier's ops HTTP address",
    )
    top.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between frames",
    )
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument(
        "--count", type=positive_int, metavar="N", help="draw N frames and exit (default: forever)"
    )
    top.add_argument("--no-color", action="store_true", help="plain text, no ANSI colours")
