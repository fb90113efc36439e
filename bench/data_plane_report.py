"""The data-plane bench's ratios against issue 14's goal, and its Markdown report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

MODES = ("unary", "stream")
NAN = float("nan")
_COLUMNS = ["row"] + [
    f"{m} {c}" for m in MODES for c in ("req/s", "P50 / P99", "1: P50", "1: +P50", "CPU")
]
HEADER = "| " + " | ".join(_COLUMNS) + " |\n" + "|---" * len(_COLUMNS) + "|"


def _get(rows: dict[str, Any], row: str, mode: str, *keys: str) -> float:
    node: Any = rows.get(row, {}).get(mode)
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return NAN
        node = node[key]
    return float(node)


def _ratio(a: float, b: float) -> float:
    """a / b; NaN when either is unknown or b is not positive (a floor that added
    nothing measurable makes no ratio)."""
    return a / b if b == b and a == a and b > 0 else NAN


def _goal(name: str, mode: str, value: float, target: str) -> dict[str, Any]:
    """``target`` is ``>= x``, ``<= x``, ``< x`` or ``-`` (reported, no goal)."""
    met: bool | None = None
    if target != "-" and value == value:
        op, limit = target.split()
        bound = float(limit)
        met = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
    return {"goal": name, "mode": mode, "value": value, "target": target, "met": met}


@dataclass(frozen=True)
class Figures:
    """One mode's medians, read by row; ``tag`` and ``tiers`` pick the compared
    checkout's tier rows and processes (the floors and peers are shared)."""

    rows: dict[str, Any]
    mode: str
    tag: str = ""
    tiers: str = "tls"

    def _row(self, row: str) -> str:
        shared = row in ("direct", "bare hop", "3 bare hops") or row.startswith("chain,")
        return row if shared else row + self.tag

    def rps(self, row: str) -> float:
        return _get(self.rows, self._row(row), self.mode, "rps")

    def cpu(self, row: str, process: str) -> float:
        process = process.replace("tls-", f"{self.tiers}-")
        return _get(self.rows, self._row(row), self.mode, "cpu_ms_per_req", process)

    def added(self, row: str) -> float:
        return _get(self.rows, self._row(row), self.mode, "idle_added_p50_ms")

    def path_cpu(self, row: str) -> float:
        return _get(self.rows, self._row(row), self.mode, "cpu_ms_per_req_path")

    def paired(self, row: str, floor: str) -> float:
        """The median over rounds of ``row``'s req/s over ``floor``'s in the same round:
        a drift of the machine's load between rounds cancels out (NaN without pairs)."""
        a, b = (
            self.rows.get(self._row(r), {}).get(self.mode, {}).get("rounds_rps")
            for r in (row, floor)
        )
        pairs = [x / y for x, y in zip(a or [], b or [], strict=False) if x and y]
        return statistics.median(pairs) if pairs else NAN


def goals(rows: dict[str, Any], tag: str = "", tiers: str = "tls") -> list[dict[str, Any]]:
    """Issue 14's goal, each figure from medians of the same run."""
    out = []
    for m in MODES:
        f = Figures(rows, m, tag, tiers)
        rps, cpu, added, path_cpu = f.rps, f.cpu, f.added, f.path_cpu
        hop_cpu, hop_added = cpu("bare hop", "hop"), added("bare hop")
        figures = [
            ("local tier / bare hop, req/s", _ratio(rps("local"), rps("bare hop")), ">= 0.8"),
            ("local tier / bare hop, CPU per request",
             _ratio(cpu("local", "tls-local"), hop_cpu), "<= 1.25"),
            ("regional tier / bare hop, CPU per request",
             _ratio(cpu("regional+local", "tls-regional"), hop_cpu), "<= 1.25"),
            ("global tier / bare hop, CPU per request",
             _ratio(cpu("chain", "tls-global"), hop_cpu), "<= 1.25"),
            ("chain / 3 bare hops, req/s", _ratio(rps("chain"), rps("3 bare hops")), ">= 0.8"),
            ("P50 added, 1 in flight: local tier / bare hop",
             _ratio(added("local"), hop_added), "<= 1.25"),
            ("P50 added, 1 in flight: regional tier (regional+local − local) / bare hop",
             _ratio(added("regional+local") - added("local"), hop_added), "<= 1.25"),
            ("P50 added, 1 in flight: global tier (chain − regional+local) / bare hop",
             _ratio(added("chain") - added("regional+local"), hop_added), "<= 1.25"),
            ("P50 added, 1 in flight: chain / 3 bare hops",
             _ratio(added("chain"), added("3 bare hops")), "<= 1.25"),
            ("tracing at the default sampler: req/s lost (chain vs tracing off)",
             1.0 - _ratio(rps("chain"), rps("chain, tracing off")), "< 0.05"),
            ("tracing at the default sampler: CPU per request added (chain vs tracing off)",
             _ratio(path_cpu("chain"), path_cpu("chain, tracing off")) - 1.0, "< 0.05"),
            ("TLS between tiers: req/s lost (chain vs TLS off)",
             1.0 - _ratio(rps("chain"), rps("chain, TLS off")), "-"),
            ("TLS between tiers: CPU per request added (chain vs TLS off)",
             _ratio(path_cpu("chain"), path_cpu("chain, TLS off")) - 1.0, "-"),
            ("local --workers 2 / 1 worker, req/s",
             _ratio(rps("local --workers 2"), rps("local")), "-"),
            ("tracing at the default sampler: req/s lost, paired by round "
             "(chain, second set vs tracing off; --twin)",
             1.0 - f.paired("chain, second set", "chain, tracing off"), "< 0.05"),
            ("noise floor: the same chain on a second tier set, req/s apart (--twin)",
             abs(1.0 - _ratio(rps("chain"), rps("chain, second set"))), "-"),
            ("noise floor: the same chain on a second tier set, CPU per request apart (--twin)",
             abs(_ratio(path_cpu("chain"), path_cpu("chain, second set")) - 1.0), "-"),
        ]  # fmt: skip
        out += [_goal(name, m, value, target) for name, value, target in figures]
    return out


def _f(value: float, digits: int = 0) -> str:
    return "n/a" if value != value else f"{value:.{digits}f}"


def _row_line(name: str, modes: dict[str, Any]) -> str:
    cells = [name]
    for m in MODES:
        r = modes.get(m, {})
        cells += [
            _f(r.get("rps", NAN)),
            f"{_f(r.get('p50_ms', NAN), 1)} / {_f(r.get('p99_ms', NAN), 1)}",
            _f(r.get("idle_p50_ms", NAN), 2),
            _f(r.get("idle_added_p50_ms", NAN), 2),
            _f(r.get("cpu_ms_per_req_path", NAN), 3),
        ]
    return "| " + " | ".join(cells) + " |"


def _cpu_line(name: str, modes: dict[str, Any]) -> str:
    parts = []
    for m in MODES:
        cpu = modes.get(m, {}).get("cpu_ms_per_req", {})
        parts.append(", ".join(f"{p} {_f(v, 3)}" for p, v in cpu.items()))
    return f"| {name} | {parts[0]} | {parts[1]} |"


def _goal_line(g: dict[str, Any]) -> str:
    met = {True: "met", False: "**not met**", None: "(reported)"}[g["met"]]
    return f"| {g['goal']} | {g['mode']} | {_f(g['value'], 2)} | {g['target']} | {met} |"


def markdown(r: dict[str, Any]) -> str:
    p, mach = r["params"], r["machine"]
    rows = "\n".join(_row_line(n, m) for n, m in r["rows"].items())
    cpu = "\n".join(_cpu_line(n, m) for n, m in r["rows"].items())
    goal_lines = "\n".join(_goal_line(g) for g in r["goals"])
    compared = _compared(r)
    missing = "\n".join(f"- {n}: {why}" for n, why in r["unavailable"].items()) or "- none"
    load = ", ".join(f"{x:.1f}" for x in mach["loadavg_at_end"])
    return f"""# Data plane — Meridian's tiers against a bare hop, nginx, HAProxy, Envoy

`python -m bench.data_plane` ({mach["cpus"]} CPUs, Python {mach["python"]},
{mach["platform"]}; load average at the end {load}, the machine shared with other work).
Code under test: `{r["checkout"]["path"]}` at `{r["checkout"]["head"]}`.
{p["gpus"]} emulated A100s in one `meridian worker` process at time scale {p["time_scale"]},
1-token generate requests, a closed loop of {p["concurrency"]} in flight from one client
process; {p["rounds"]} rounds of {p["seconds"]} s windows (after {p["warmup"]} s warm-up),
rows interleaved, medians over rounds. Placement: {r["placement"]}.
Meridian rows run with mutual TLS between tiers, tenant auth and limits at the edge and
tracing at the default sampler (1 in 10), as `meridian up` does; the bare hops, nginx,
HAProxy and Envoy serve mutual TLS to the caller like the local tier (the hops in series
like the chain: plaintext edge, TLS between hops) and speak h2c to the GPUs.

Latency in ms. *req/s*, *P50 / P99* and *CPU* with {p["concurrency"]} in flight; *1: P50*
with one request in flight ({p["idle_seconds"]} s window, no queueing) and *1: +P50* what
that adds over *direct* in the same round: the latency a hop adds. *CPU* = CPU ms per
request of the data plane's processes (tiers, hops or peer, and Redis for Meridian rows;
not the client, not the GPUs), from /proc utime+stime, pooled over the rounds (all CPU
over all requests); req/s and latencies are medians over rounds.

{HEADER}
{rows}

CPU ms per request of every process in the path (*driver* is the client, *gpus* the
GPU worker process):

| row | unary | stream |
|---|---|---|
{cpu}

Against issue 14's goal (ratios of the medians above):

| figure | mode | value | goal | |
|---|---|---|---|---|
{goal_lines}

{compared}Not measured:
{missing}
"""


def _compared(r: dict[str, Any]) -> str:
    """The compared checkout's goal figures beside this one's (same run, same rounds)."""
    if not r.get("compared"):
        return ""
    pairs = zip(r["goals"], r["goals_compared"], strict=True)
    lines = "\n".join(
        f"| {a['goal']} | {a['mode']} | {_f(a['value'], 2)} | {_f(b['value'], 2)} | {a['target']} |"
        for a, b in pairs
        if "tracing" not in a["goal"] and "TLS" not in a["goal"] and "workers" not in a["goal"]
    )
    c = r["compared"]
    return f"""Compared in the same run (rows marked *[compared]*: the tiers of `{c["path"]}` at
`{c["head"]}`, on the same GPUs, hops and client, interleaved with this checkout's):

| figure | mode | this checkout | compared | goal |
|---|---|---|---|---|
{lines}

"""
