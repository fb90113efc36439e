"""Chaos bench: a real ``meridian up`` fleet under load, one fault at a time.

    python -m bench.chaos                  # the whole matrix, writes bench/results/chaos.json
    python -m bench.chaos --quick          # a subset with shorter holds (about two minutes)
    python -m bench.chaos --faults sigkill-redis,unread-streams --no-write

The fleet is the demo fleet (``chaos_fleet``), started by ``meridian up`` from this checkout.
The load (``chaos_load``) runs the whole time: tenant ``demo``'s closed loop of mixed unary
and streaming calls from five cities, and tenant ``free-tier`` probing its quota. The faults
(``chaos_faults``) are SIGKILL and SIGSTOP of a GPU worker process, a local tier, a regional
tier and Redis, a graceful Redis restart, 500 streams that are never read, and the limited
tenant's multi-request streams. Per fault it reports (``chaos_report``, ``chaos_table``)
failed calls by time since the fault, usage records lost, doubled or erased, and the
limited tenant's quota overshoot. Every process it starts is stopped at the end, whatever
happened (stopped ones get SIGCONT first), and ``--budget-s`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.chaos_faults import (
    FAULTS,
    FULL_TIMING,
    LIMITED_TENANT,
    QUICK,
    QUICK_TIMING,
    Abuse,
    Bench,
    Fault,
    Phase,
    Timing,
    run_phase,
)
from bench.chaos_fleet import FleetUnderTest, bench_fleet_spec
from bench.chaos_load import CITIES, Load, good_caller, limited_caller
from bench.chaos_report import phase_figures, summary_usage, usage_windows
from bench.chaos_table import markdown, render
from bench.chaos_usage import read_usage
from bench.report import machine, revision
from cli.launcher import DEMO_FLEET
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results"
EXCLUDED = (
    "the global tier: it is the clients' only endpoint and the topology has a single "
    "`global` entry, so `meridian up` cannot run a second replica to fail over to; killing "
    "it fails every call by construction",
)


class OverBudget(Exception):
    """The whole run took longer than ``--budget-s``."""


class RunFailed(Exception):
    """A step inside the run gave up (a restarted process not ready in time, say): not
    the budget, whatever the exception's type; the message says which step."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help=f"faults {','.join(QUICK)}, short holds")
    p.add_argument("--faults", help="comma-separated fault names (default: all, or --quick's)")
    p.add_argument("--fleet", type=Path, default=DEMO_FLEET, help="fleet YAML to start")
    p.add_argument("--concurrency", type=int, default=32, help="good callers")
    p.add_argument("--stream-share", type=float, default=0.25)
    p.add_argument("--limited-callers", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=4.0, help="every good call's deadline")
    _slow_reader_options(p)
    p.add_argument(
        "--timing",
        help="PRE,HOLD,SETTLE,WINDOW seconds of each phase (default: the mode's, "
        f"full {','.join(f'{v:g}' for v in vars(FULL_TIMING).values())})",
    )
    p.add_argument("--max-shots", type=int, default=2_000_000, help="bound on calls made")
    p.add_argument("--budget-s", type=float, default=None, help="hard limit (default 300/900)")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--keep-logs", action="store_true", help="keep the fleet's run directory")
    p.add_argument(
        "--out",
        type=Path,
        help="the JSON to write (default bench/results/chaos.json for the whole matrix, "
        "chaos_quick.json for --quick or a --faults subset; a .md beside it)",
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    names = [f.name for f in FAULTS]
    chosen = args.faults.split(",") if args.faults else list(QUICK if args.quick else names)
    unknown = [n for n in chosen if n not in names]
    if unknown:
        p.error(f"--faults: unknown {unknown}; known: {names}")
    args.chosen = [f for n in chosen for f in FAULTS if f.name == n]
    args.budget_s = args.budget_s or (300.0 if args.quick else 900.0)
    args.phase_timing = QUICK_TIMING if args.quick else FULL_TIMING
    if args.timing:
        try:
            seconds = [float(v) for v in args.timing.split(",")]
            if len(seconds) != 4 or not all(0 <= v < 3600 for v in seconds):
                raise ValueError(args.timing)
            args.phase_timing = Timing(*seconds)
        except ValueError:
            p.error(f"--timing: expected four numbers PRE,HOLD,SETTLE,WINDOW, got {args.timing}")
    whole = not args.quick and not args.faults
    args.out = args.out or RESULTS / ("chaos.json" if whole else "chaos_quick.json")
    args.command = " ".join(["python -m bench.chaos", *(sys.argv[1:] if argv is None else argv)])
    return args


def _slow_reader_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--unread-streams", type=int, default=500)
    p.add_argument("--unread-max-tokens", type=int, default=256, help="each unread stream's")
    p.add_argument(
        "--unread-read",
        action="store_true",
        help="a control: the bulk streams are read as they come (the same load, kept up with)",
    )
    p.add_argument(
        "--stream-coalesce-ms",
        type=float,
        default=None,
        help="limits.stream_coalesce_ms of the fleet (default: the fleet file's)",
    )
    p.add_argument(
        "--bulk-max-concurrent",
        type=int,
        default=2048,
        help="max_concurrent of tenant bulk, who opens the unread streams (default 2048)",
    )


async def _run(args: argparse.Namespace, fleet: FleetUnderTest) -> dict[str, Any]:
    """Start the fleet and the load, run the phases, check usage; the caller cleans up."""
    await asyncio.to_thread(fleet.start)
    load = Load(fleet.global_address, fleet.tenant_keys, args.max_shots, args.timeout_s)
    rng = random.Random(args.seed)
    channels = [grpc.aio.insecure_channel(load.target) for _ in range(2)]
    good_stub, limited_stub = (pb_grpc.GRPCInferenceServiceStub(c) for c in channels)
    tasks = [
        asyncio.create_task(
            good_caller(load, good_stub, random.Random(rng.random()), args.stream_share)
        )
        for _ in range(args.concurrency)
    ]
    tasks += [
        asyncio.create_task(
            limited_caller(load, limited_stub, random.Random(rng.random()), LIMITED_TENANT)
        )
        for _ in range(args.limited_callers)
    ]
    abuse = Abuse(
        unread_streams=args.unread_streams,
        unread_max_tokens=args.unread_max_tokens,
        unread_read=args.unread_read,
    )
    timing = args.phase_timing
    bench = Bench(fleet, load, limited_stub, timing, abuse, rng)
    cpu0, wall0, own0, load0 = (
        fleet.sample_cpu(),
        time.monotonic(),
        time.process_time(),
        os.getloadavg(),
    )
    phases: list[Phase] = [await _baseline(fleet)]
    try:
        for fault in args.chosen:
            print(f"[{time.monotonic() - wall0:6.1f} s] {fault.name}", flush=True)
            phases.append(await run_phase(bench, fault))
    finally:
        load.stopping = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close(grace=None)
    cpu = _cpu(fleet, cpu0, wall0, own0, load0)
    await asyncio.sleep(2.0)  # the last records' flush
    final = await asyncio.to_thread(read_usage, fleet.redis_url)
    return _result(args, fleet, load, phases[1:], phases[0], final, cpu, timing, abuse)


async def _baseline(fleet: FleetUnderTest) -> Phase:
    """The usage stream as the first phase finds it: what a first fault could erase."""
    phase = Phase(Fault("start", "none", "-"), time.monotonic())
    phase.usage = await asyncio.to_thread(read_usage, fleet.redis_url)
    phase.end = time.monotonic()
    return phase


def _cpu(
    fleet: FleetUnderTest,
    cpu0: dict[str, float],
    wall0: float,
    own0: float,
    load0: tuple[float, float, float],
) -> dict[str, Any]:
    wall = time.monotonic() - wall0
    cpu1 = fleet.sample_cpu()
    cores = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu1}
    cores["bench"] = (time.process_time() - own0) / wall
    return {
        "wall_s": round(wall, 1),
        "nproc": os.cpu_count(),
        "cores": {k: round(v, 3) for k, v in cores.items()},
        "loadavg_start": round(load0[0], 2),
        "loadavg_end": round(os.getloadavg()[0], 2),
    }


def _result(
    args: argparse.Namespace,
    fleet: FleetUnderTest,
    load: Load,
    phases: list[Phase],
    start: Phase,
    final: Any,
    cpu: dict[str, Any],
    timing: Any,
    abuse: Abuse,
) -> dict[str, Any]:
    assert fleet.topology is not None
    tenant = fleet.topology.auth.tenant(LIMITED_TENANT)
    windows = usage_windows(phases, load.shots)
    figures, previous = [], start.usage
    for phase, checked in zip(phases, windows, strict=True):
        figures.append(phase_figures(phase, load.shots, checked, previous, tenant))
        previous = phase.usage
    return {
        "bench": "chaos",
        "machine": machine(),
        "revision": revision(),
        "config": {
            "mode": "quick" if args.quick else "full",
            "command": args.command,
            "faults": [f.name for f in args.chosen],
            "concurrency": args.concurrency,
            "stream_share": args.stream_share,
            "cities": sorted(CITIES),
            "timeout_s": args.timeout_s,
            "limited_tenant": LIMITED_TENANT,
            "limited_callers": args.limited_callers,
            "timing": vars(timing),
            "abuse": vars(abuse),
            "seed": args.seed,
        },
        "calls": len(load.shots),
        "phases": figures,
        "run_usage": summary_usage(load.shots, final).as_dict(),
        "cpu": cpu,
        "excluded": list(EXCLUDED),
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="meridian-chaos-"))
    print(f"run directory {run_dir}", flush=True)
    spec = bench_fleet_spec(args.fleet, bulk_max_concurrent=args.bulk_max_concurrent)
    if args.stream_coalesce_ms is not None:
        spec.setdefault("limits", {})["stream_coalesce_ms"] = args.stream_coalesce_ms
    fleet = FleetUnderTest(run_dir, spec)
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        # The budget cancels the run (CancelledError inside, TimeoutError out of the
        # block); a TimeoutError inside is a step's own (a wait that gave up).
        async with asyncio.timeout(args.budget_s):
            try:
                return await _run(args, fleet)
            except TimeoutError as exc:
                raise RunFailed(f"{type(exc).__name__}: {exc}") from exc
    except TimeoutError as exc:
        raise OverBudget(f"over --budget-s ({args.budget_s:.0f} s)") from exc
    finally:
        await asyncio.to_thread(fleet.close)
        if not args.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        result = asyncio.run(_main(args))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("interrupted; every process the bench started is stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except (OverBudget, RunFailed) as exc:
        print(f"{exc}; everything stopped", file=sys.stderr)
        raise SystemExit(1) from None
    print(render(result), flush=True)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {args.out} and {args.out.with_suffix('.md').name}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
