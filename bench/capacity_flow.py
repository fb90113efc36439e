"""Capacity flow and region failover, measured on real processes (a benchmark, not a test).

Four figures from one run:

1. **propagation** — a zone's worker process (both its GPUs) is killed, then
   started again, ``--cycles`` times; the delay from the change to the first
   ``meridian:capacity:region:{regions}:<region>`` entry whose ``healthy_gpus`` shows it
   (``bench.capacity_propagation``).
2. **redis cost** — in-process, on a fresh embedded Redis: 125 zone publishers
   (8 GPUs each, 1000 GPUs), 16 regional readers + publishers and one global
   reader, at the 500 ms cadence (``bench.capacity_redis_cost``).
3. **failover** — 8 closed-loop unary clients from Dublin against the global
   endpoint of a 2-region fleet; ``regional-eu-west`` is SIGKILLed mid-run:
   time until requests land in us-east, and failed requests.
4. **return** — the regional tier is started again; eu-west's share of
   completions per 250 ms after it is ready (3 and 4: ``bench.capacity_failover``).

This module is the entry point: the options, the order of the measurements and the
fleet's lifetime. The fleet itself is ``bench.capacity_fleet``; the Markdown and JSON
report is ``bench.capacity_report``.

All process control happens on the main thread (children get PR_SET_PDEATHSIG
from the thread that started them); the load and the stream watcher run in
threads of their own. Every process started here is stopped in ``finally``.

    .venv/bin/python -m bench.capacity_flow              # full run (~2 min), writes results
    .venv/bin/python -m bench.capacity_flow --cycles 3 --redis-s 3 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import yaml

from bench.capacity_failover import Failover, failover
from bench.capacity_fleet import ZONE, fleet_spec, ms
from bench.capacity_propagation import Propagation, propagation
from bench.capacity_redis_cost import redis_cost
from bench.capacity_report import markdown, write
from bench.report import machine, revision
from cli.launcher import Fleet


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cycles", type=int, default=15, help="kill/restart cycles for (1)")
    parser.add_argument("--redis-s", type=float, default=10.0, help="measured seconds for (2)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--down-s", type=float, default=4.0, help="region down for (3)")
    parser.add_argument("--back-s", type=float, default=12.0, help="watched after return (4)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-logs", action="store_true", help="keep the fleet's run dir")
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


def _on_the_fleet(
    args: argparse.Namespace, rng: random.Random
) -> tuple[Failover, Propagation, float]:
    """(3)+(4) then (1) on one fleet; returns their figures and the fleet's summary cadence."""
    run_dir = tempfile.mkdtemp(prefix="meridian-capacity-flow-")
    fleet: Fleet | None = None
    try:
        spec_path = Path(run_dir) / "fleet.yaml"
        spec_path.write_text(yaml.safe_dump(fleet_spec(args.time_scale)))
        fleet = Fleet(spec_path, Path(run_dir) / "run")
        cadence_s = fleet.topology.summary_cadence_s
        print(f"starting the fleet (logs in {run_dir}/run) ...", flush=True)
        fleet.start(timeout_s=90)
        # (3)+(4) first, on a settled fleet: the kills of (1) take eu-west down and
        # start the global tier's fail-back ramp, which would skew the "before" share.
        print("(3)+(4) killing and restarting regional-eu-west under load ...", flush=True)
        fo = failover(
            fleet,
            clients=args.clients,
            max_tokens=args.max_tokens,
            warm_s=3.0,
            down_s=args.down_s,
            back_s=args.back_s,
        )
        print(
            f"    moved in {ms(fo.move_95_s)}, {fo.failed} failed "
            f"({fo.failed_started_after_kill} started after the kill)",
            flush=True,
        )
        print(f"(1) propagation: {args.cycles} kill/restart cycles of worker-{ZONE}", flush=True)
        prop = propagation(fleet, args.cycles, rng)
    finally:
        if fleet is not None:
            fleet.stop()
        if not args.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
    return fo, prop, cadence_s


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    rng = random.Random(args.seed)
    began = time.monotonic()
    load_start = os.getloadavg()[0]  # other work on the machine skews every figure here

    print("(2) Redis cost: 1000 GPUs in 125 zones / 16 regions ...", flush=True)
    cost = asyncio.run(redis_cost(args.redis_s, rng))
    print(
        f"    {cost.commands_per_s:.0f} commands/s, Redis CPU "
        f"{cost.redis_cpu_share_of_one_core * 100:.1f} %, "
        f"{cost.memory_at_maxlen_bytes / 2**20:.1f} MiB at MAXLEN",
        flush=True,
    )
    fo, prop, cadence_s = _on_the_fleet(args, rng)

    info = {
        **machine(),
        **revision(),
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0],
    }
    table = markdown(info, prop, cost, fo, cadence_s)
    print()
    print(table)
    print(f"(whole run: {time.monotonic() - began:.0f} s)")
    if not args.no_write:
        write(info, prop, cost, fo, table)


if __name__ == "__main__":
    main()
