"""Throughput of the local tier with 1 and 2 workers (``meridian local --workers 2``), in
one run, on ``bench.data_plane``'s stack (the same GPUs, mutual TLS, driver, placement).

Rows, interleaved in rounds (each figure the median over rounds):

* *1 worker, 1 connection*: the data-plane bench's ``local`` row, as a parent tier
  reaches a child (one HTTP/2 connection);
* *1 worker, 16 connections*: the same process, the driver's clients spread over 16
  connections (so the next row's gain is not the connections');
* *1 worker unpinned, 16 connections*: the same process let onto both cores for the
  window, as the two workers run;
* *--workers 2, 16 connections*: the supervisor and its two workers on one port; the
  kernel hands each connection to one worker (SO_REUSEPORT);
* *direct to the GPUs*: no tier at all, the ceiling of the driver and GPUs' core.

Placement (``bench.data_plane_stack``): the driver and the GPU worker process on core 0,
the 1-worker tier on core 1, the 2 workers unpinned (both cores, shared with the driver
and the GPUs). On a 2-core machine the ratio is therefore what a second core buys when
the load generator and the GPUs already use part of it, not a clean 2x ceiling: the
CPU per request (every process of the row's path, from /proc) is the figure that does
not depend on how the cores were shared.

    python -m bench.workers             # ~2 min, writes bench/results/workers.{json,md}
    python -m bench.workers --quick     # ~1 min smoke, writes nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.data_plane import MODES, RESULTS, _median, _pooled, check_rows, measure
from bench.data_plane_fleet import pin
from bench.data_plane_stack import BENCH_ROOT, WORKER_CONNECTIONS, Row, Stack
from bench.report import git_head, write_json_and_markdown

DIRECT = "direct to the GPUs"
ONE = "1 worker, 1 connection"
ONE_MANY = f"1 worker, {WORKER_CONNECTIONS} connections"
ONE_FREE = f"1 worker unpinned, {WORKER_CONNECTIONS} connections"
TWO = f"--workers 2, {WORKER_CONNECTIONS} connections"


def rows_of(stack: Stack) -> list[Row]:
    """The rows, from the stack's ``direct``, ``local`` and ``local --workers 2`` rows."""
    by_name = {row.name: row for row in stack.rows}
    local, workers = by_name["local"], by_name["local --workers 2"]
    many = dataclasses.replace(local, connections=WORKER_CONNECTIONS)
    return [
        dataclasses.replace(by_name["direct"], name=DIRECT),
        dataclasses.replace(local, name=ONE),
        dataclasses.replace(many, name=ONE_MANY),
        dataclasses.replace(many, name=ONE_FREE),
        dataclasses.replace(workers, name=TWO),
    ]


def measure_row(stack: Stack, row: Row, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One window; the ONE_FREE row runs the 1-worker tier on every core, as the two
    workers run, and puts it back on its own core after."""
    tier = stack.procs["tls-local"].pid
    if row.name == ONE_FREE:
        pin(tier, frozenset(range(os.cpu_count() or 1)))
    try:
        return measure(stack, row, mode, args.seconds, args.warmup, args.concurrency)
    finally:
        if row.name == ONE_FREE:
            pin(tier, stack.router_cpus)


def summarise(windows: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, modes in windows.items():
        rows[name] = {}
        for mode, ws in modes.items():
            ok = [w for w in ws if "failed" not in w]
            procs = {p for w in ok for p in w["cpu_ms_per_req"]} - {"driver", "gpus"}
            rows[name][mode] = {
                "rps": _median([w["rps"] for w in ok]),
                "p50_ms": _median([w["p50_ms"] for w in ok]),
                "p99_ms": _median([w["p99_ms"] for w in ok]),
                "errors": sum(w["errors"] for w in ok),
                "failed_windows": [w["failed"] for w in ws if "failed" in w],
                "cpu_ms_per_req_tier": _pooled(ok, procs),
                # Cores busy over the window: the tier, and the driver + GPUs beside it.
                "cores_tier": _median([_cores(w, procs) for w in ok]),
                "cores_driver_gpus": _median([_cores(w, {"driver", "gpus"}) for w in ok]),
                "rounds_rps": [w.get("rps") for w in ws],
            }
    ratios = {
        mode: {
            "workers2_over_1worker_same_connections": _ratio(rows, TWO, ONE_MANY, mode),
            "workers2_over_1worker_1connection": _ratio(rows, TWO, ONE, mode),
            "workers2_over_1worker_unpinned": _ratio(rows, TWO, ONE_FREE, mode),
            "1worker_over_direct": _ratio(rows, ONE_MANY, DIRECT, mode),
        }
        for mode in MODES
    }
    return {"rows": rows, "ratios": ratios}


def _cores(window: dict[str, Any], processes: set[str]) -> float:
    used = sum(s for p, s in window["cpu_s"].items() if p in processes)
    return float(used / window["seconds"]) if window["seconds"] else float("nan")


def _ratio(rows: dict[str, Any], a: str, b: str, mode: str) -> float:
    try:
        return float(rows[a][mode]["rps"] / rows[b][mode]["rps"])
    except (KeyError, ZeroDivisionError):
        return float("nan")


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Local tier: 1 worker against `--workers 2`",
        "",
        f"Code: `{result['checkout']}`; {result['machine']['cpus']} cores; "
        f"{result['params']['rounds']} rounds of {result['params']['seconds']} s, "
        f"{result['params']['concurrency']} clients in a closed loop, 1-token requests, "
        f"{result['params']['gpus']} emulated GPUs.",
        f"Placement: {result['placement']}.",
        "",
        "| row | mode | req/s | P50 ms | P99 ms | tier CPU ms/req | cores: tier "
        "| cores: driver + GPUs | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, modes in result["rows"].items():
        for mode, r in modes.items():
            lines.append(
                f"| {name} | {mode} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
                f"| {r['cpu_ms_per_req_tier']:.3f} | {r['cores_tier']:.2f} "
                f"| {r['cores_driver_gpus']:.2f} | {r['errors']} |"
            )
    lines += ["", "| ratio (req/s) | unary | stream |", "|---|---:|---:|"]
    for key, label in (
        ("workers2_over_1worker_same_connections", f"--workers 2 / {ONE_MANY}"),
        ("workers2_over_1worker_1connection", f"--workers 2 / {ONE}"),
        ("workers2_over_1worker_unpinned", f"--workers 2 / {ONE_FREE}"),
        ("1worker_over_direct", f"{ONE_MANY} / {DIRECT} (the ceiling of core 0)"),
    ):
        unary, stream = (result["ratios"][m][key] for m in MODES)
        lines.append(f"| {label} | {unary:.2f}x | {stream:.2f}x |")
    lines += [
        "",
        "The second core is shared with the load generator and the GPUs' process (core 0), so",
        "the ratio is what two workers get out of the machine as it is, not a 2x ceiling:",
        f"*{DIRECT}* is what core 0 (driver and GPUs) manages with no tier in between; a tier",
        "row near it is capped there, and only its CPU per request can still improve.",
    ]
    unavailable = result.get("unavailable") or {}
    for name, why in unavailable.items():
        lines.append(f"- {name}: {why}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    checkout = Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or BENCH_ROOT)
    windows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="meridian-workers-") as tmp:
        stack = Stack(Path(tmp), checkout.resolve(), gpus=args.gpus, peers=())
        try:
            started = time.monotonic()
            stack.start()
            stack.rows = rows_of(stack)
            rows = check_rows(stack, args)
            print(f"ready in {time.monotonic() - started:.1f} s: {[r.name for r in rows]}")
            for i in range(args.rounds):
                for row in rows:
                    for mode in MODES:
                        w = measure_row(stack, row, mode, args)
                        windows.setdefault(row.name, {}).setdefault(mode, []).append(w)
                        rps = w.get("rps", 0.0)
                        print(f"round {i + 1} {row.name:32s} {mode:6s} {rps:7.0f} req/s")
        finally:
            stack.stop()
    return {
        **summarise(windows),
        "checkout": git_head(checkout),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "params": {k: v for k, v in vars(args).items() if k != "no_write"},
        "placement": "driver + GPU worker on core 0; the 1-worker tier and Redis on core 1; "
        "--workers 2 unpinned",
        "unavailable": stack.unavailable,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 short round, writes nothing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per window")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.no_write = 1, 0.5, 0.2, True
    result = run(args)
    text = markdown(result)
    print(text)
    if not args.no_write:
        write_json_and_markdown(RESULTS, "workers", result, text)


if __name__ == "__main__":
    main()
