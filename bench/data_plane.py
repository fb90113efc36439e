"""What each data plane costs per request: Meridian's tiers against a bare Python hop,
nginx, HAProxy and Envoy, on the same emulated GPUs, in one run.

Rows (``bench.data_plane_stack``): *direct* to the GPUs; a *bare hop* (a grpc.aio
byte pass-through, ``bench.data_plane_hop``: the floor for a Python hop); the *local*
tier alone; *regional+local*; the whole *chain* (global → regional → local); *3 bare
hops* in series (the chain's floor); *nginx* ``grpc_pass``, *HAProxy* h2 and *Envoy*;
the local tier with ``--workers 2`` (over 16 connections) when the code under test has
the flag; the chain with *TLS off* and with *tracing off*. Every Meridian row runs as
``meridian up`` would: mutual TLS between tiers, tenant auth (and limits) at the edge,
tracing at the default sampler. Columns: unary ModelInfer and one ModelStreamInfer
stream per request, 1 token against near-instant GPUs (``--time-scale``), a closed loop
of ``--concurrency``.

Rows are interleaved in rounds (every row once per round, unary then stream; every other
round in reverse order) and each figure is the median over rounds. Per window:
requests/s, P50/P99 latency and the P50 added over *direct* in the same round, and the
CPU seconds per request of every process in the row's path (utime+stime from /proc, the
driver included), the figure that does not depend on how the cores were shared.

    python -m bench.data_plane                 # full run, ~5 min, writes bench/results/
    python -m bench.data_plane --quick         # ~40 s smoke, writes nothing
    PYTHONPATH=../other python -m bench.data_plane --name data_plane_other   # tiers run ../other
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.data_plane_load import ProcCpu
from bench.data_plane_report import goals, markdown
from bench.data_plane_stack import BENCH_ROOT, COMPARED, Row, Stack
from bench.report import git_head, write_json_and_markdown

RESULTS = Path(__file__).parent / "results"
MODES = ("unary", "stream")


def checkout_under_test(given: str | None) -> Path:
    """``--checkout``, else the first ``PYTHONPATH`` entry, else this bench's checkout."""
    if given:
        return Path(given).resolve()
    first = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    return Path(first).resolve() if first else BENCH_ROOT


def measure(
    stack: Stack, row: Row, mode: str, seconds: float, warmup: float, concurrency: int
) -> dict[str, Any]:
    """One window through ``row``: the driver's figures and every process's CPU."""
    cpu = ProcCpu(stack.pids(row))
    stack.send(stack.job(row, mode, seconds, warmup, concurrency))
    used: dict[str, float] = {}
    while not (line := stack.read()).startswith("{"):
        if line == "begin":
            cpu.start()
        elif line == "end":
            used = cpu.stop()
    result: dict[str, Any] = json.loads(line)
    if "failed" in result:
        return {"failed": result["failed"]}
    result.pop("latencies_ms", None)
    done = max(1, result["done"])
    result["cpu_s"] = used
    result["cpu_ms_per_req"] = {name: 1000.0 * s / done for name, s in used.items()}
    result["cpu_ms_per_req_path"] = sum(
        v for k, v in result["cpu_ms_per_req"].items() if k not in ("driver", "gpus")
    )
    return result


def check_rows(stack: Stack, args: argparse.Namespace) -> list[Row]:
    """The rows one request passes through (unary and stream), retried for a while;
    a row that never passes is reported as unavailable, with the error."""
    usable = []
    for row in stack.rows:
        error = ""
        for _ in range(40):
            error = ""
            for mode in MODES:
                stack.send(stack.job(row, mode, 0.05, 0.0, 1))
                while not (line := stack.read()).startswith("{"):
                    pass  # begin, end
                got = json.loads(line)
                if "failed" in got or got["errors"] or not got["done"]:
                    error = got.get("failed") or got.get("first_error") or "no request finished"
            if not error:
                break
            time.sleep(0.25)
        if error:
            stack.unavailable[row.name] = f"failed: {error}"
        else:
            usable.append(row)
    return usable


def run(args: argparse.Namespace) -> dict[str, Any]:
    checkout = checkout_under_test(args.checkout)
    windows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="meridian-data-plane-") as tmp:
        compare = Path(args.compare).resolve() if args.compare else None
        stack = Stack(
            Path(tmp), checkout, gpus=args.gpus, time_scale=args.time_scale,
            pin=not args.no_pin, compare=compare, twin=args.twin,
        )  # fmt: skip
        try:
            started = time.monotonic()
            stack.start()
            print(f"started in {time.monotonic() - started:.1f} s", flush=True)
            rows = check_rows(stack, args)
            print(
                f"checked in {time.monotonic() - started:.1f} s: {[r.name for r in rows]}",
                flush=True,
            )
            for name, why in stack.unavailable.items():
                print(f"  {name}: {why}", flush=True)
            for i in range(args.rounds):
                # Every other round backwards: no row always runs after the same one.
                for row in rows if i % 2 == 0 else rows[::-1]:
                    for mode in MODES:
                        w = measure(stack, row, mode, args.seconds, args.warmup, args.concurrency)
                        # The latency one request adds, without queueing: 1 in flight.
                        idle = measure(stack, row, mode, args.idle_seconds, args.warmup / 2, 1)
                        w["idle"] = idle
                        windows.setdefault(row.name, {}).setdefault(mode, []).append(w)
                        rps = w.get("rps", 0.0)
                        print(
                            f"round {i + 1} {row.name:20s} {mode:6s} {rps:7.0f} req/s", flush=True
                        )
            print(f"measured in {time.monotonic() - started:.1f} s", flush=True)
        finally:
            stack.stop()
    print(f"stopped in {time.monotonic() - started:.1f} s", flush=True)
    return summarise(args, checkout, windows, stack)


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # NaN: a window without a finished request
    return statistics.median(values) if values else float("nan")


def _pooled(windows: list[dict[str, Any]], processes: set[str]) -> float:
    done = sum(w["done"] for w in windows)
    used = sum(s for w in windows for p, s in w["cpu_s"].items() if p in processes)
    return 1000.0 * used / done if done else float("nan")


def summarise(
    args: argparse.Namespace, checkout: Path, windows: dict[str, Any], stack: Stack
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    direct = windows.get("direct", {})
    for name, modes in windows.items():
        rows[name] = {}
        for mode, ws in modes.items():
            ok = [w for w in ws if "failed" not in w]
            pairs = [
                (w, d) for w, d in zip(ws, direct.get(mode, []), strict=False)
                if "failed" not in w and "failed" not in d
            ]  # fmt: skip
            added = [w["p50_ms"] - d["p50_ms"] for w, d in pairs]
            idle = [(w["idle"], d["idle"]) for w, d in pairs]
            idle = [(w, d) for w, d in idle if "failed" not in w and "failed" not in d]
            procs = sorted({p for w in ok for p in w["cpu_ms_per_req"]})
            rows[name][mode] = {
                "rps": _median([w["rps"] for w in ok]),
                "p50_ms": _median([w["p50_ms"] for w in ok]),
                "p99_ms": _median([w["p99_ms"] for w in ok]),
                "added_p50_ms": _median(added),
                "idle_p50_ms": _median([w["p50_ms"] for w, _ in idle]),
                "idle_p99_ms": _median([w["p99_ms"] for w, _ in idle]),
                "idle_added_p50_ms": _median([w["p50_ms"] - d["p50_ms"] for w, d in idle]),
                "errors": sum(w["errors"] for w in ok),
                "failed_windows": [w["failed"] for w in ws if "failed" in w],
                # Pooled over the rounds (all CPU / all requests): a window that lost its
                # core counts for the few requests it served, and 10 ms ticks add up.
                "cpu_ms_per_req": {p: _pooled(ok, {p}) for p in procs},
                "cpu_ms_per_req_path": _pooled(ok, set(procs) - {"driver", "gpus"}),
                "rounds_rps": [w.get("rps") for w in ws],
            }
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "checkout": {"path": str(checkout), "head": git_head(checkout)},
        "compared": (
            None
            if stack.compare is None
            else {"path": str(stack.compare), "head": git_head(stack.compare)}
        ),
        "params": {k: v for k, v in vars(args).items() if k not in ("no_write", "name")},
        "placement": (
            "unpinned"
            if args.no_pin or (os.cpu_count() or 1) < 2
            else "driver + GPU worker on core 0; tiers, hops, peers, Redis on core 1; "
            "--workers 2 unpinned"
        ),
        "unavailable": stack.unavailable,
        "rows": rows,
        "goals": goals(rows),
        "goals_compared": goals(rows, COMPARED, "cmp") if stack.compare is not None else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 short round, writes nothing")
    # Many short rounds rather than a few long ones: on a shared machine a row's window
    # now and then loses its core to other work, and the median of 5 leaves that out.
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.2, help="measured seconds per window")
    parser.add_argument("--warmup", type=float, default=0.3, help="unmeasured seconds first")
    parser.add_argument(
        "--idle-seconds", type=float, default=0.5, help="seconds of the 1-in-flight window"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.001)
    parser.add_argument("--no-pin", action="store_true", help="let every process use every core")
    parser.add_argument("--checkout", help="the code the tiers run (default: PYTHONPATH[0])")
    parser.add_argument(
        "--compare",
        metavar="DIR",
        help="also run another checkout's tiers, as rows marked [compared] (before/after)",
    )
    parser.add_argument(
        "--twin",
        action="store_true",
        help="also a second tier set like the first, its chain as a row: the run's noise floor",
    )
    parser.add_argument(
        "--name", default="data_plane", help="results file name (e.g. data_plane_hotpath)"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.no_write = 1, 0.5, 0.2, True
        args.idle_seconds = 0.3
    result = run(args)
    text = markdown(result)
    print(text)
    if not args.no_write:
        write_json_and_markdown(RESULTS, args.name, result, text)


if __name__ == "__main__":
    main()
