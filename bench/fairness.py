"""Tenant fairness in the local tier's central queue, in-process (a benchmark, not a test).

One local tier over ``--gpus`` emulated A100s (``ZoneWorkers``, real gRPC on loopback, a
real embedded Redis for the capacity publisher), two tenants of equal weight in the
topology's ``auth`` section. Requests go straight to the local tier's V2 endpoint with the
internal metadata ``x-meridian-tenant`` (which the local tier trusts from the tier above).

1. **calibrate**: closed loop with more clients than slots; C = requests/s the zone
   finishes at the chosen request size, at full batch.
2. **alone**: tenant ``steady`` sends Poisson at ``--steady-share`` × C.
3. **contended**: the same steady stream (same seed: same arrivals, same prompts) while
   tenant ``flood`` sends Poisson at ``--flood-x`` × its fair share (C / 2), each flood
   request with a ``--flood-deadline-s`` deadline so the queue sheds it; the local tier
   keeps its reserved headroom (``tenant_headroom``, ``--headroom``).
4. **VTC only**: as (3) with no reserved headroom: what the queue's fairness alone gives.
5. **no fairness**: as (4), but both streams carry the same tenant id, so inside the
   central queue they are one FIFO — what the virtual token counter buys.
6. **contended, short steady deadline**: as (3) with fewer steady requests whose deadline
   (``--short-deadline-s``) is shorter than the flood's backlog but longer than steady's
   contended latency: does the queue's admission check let them in?

Latency is measured from each request's scheduled (Poisson) send time. To tell queueing
apart from GPU slowdown, the central queue's public ``enqueue`` is wrapped on this
instance to time each tenant's wait in it (instrumentation only; the router's code is
unchanged), every GPU's batch and engine FIFO are sampled every 20 ms, and the engines'
token counters give the share of GPU time spent prefilling.

    .venv/bin/python -m bench.fairness              # full run (~2.5 min), writes results
    .venv/bin/python -m bench.fairness --steady-requests 150 --no-write

The pieces: ``bench.fairness_zone`` (the topology, the queue probe, the GPU monitor),
``bench.fairness_load`` (the Poisson streams and the calibration), ``bench.fairness_phases``
(the runs and their figures), ``bench.fairness_report`` (the Markdown and the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from bench.fairness_load import calibrate
from bench.fairness_phases import Rig, open_rig, phase_specs, run_phase
from bench.fairness_report import describe, markdown, payload
from bench.fairness_zone import settle
from bench.report import machine, revision

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument(
        "--headroom", type=float, default=None, help="tenant_headroom (default: the topology's)"
    )
    parser.add_argument("--slots", type=int, default=16, help="max_concurrency per GPU")
    parser.add_argument("--time-scale", type=float, default=2.0, help="emulated GPU slowness")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--health-interval-s", type=float, default=2.0, help="GPU health/metrics poll"
    )
    parser.add_argument("--steady-requests", type=int, default=600)
    parser.add_argument("--steady-share", type=float, default=0.4, help="steady rate / C")
    parser.add_argument("--steady-deadline-s", type=float, default=10.0)
    parser.add_argument("--flood-x", type=float, default=10.0, help="flood rate / fair share")
    parser.add_argument("--flood-deadline-s", type=float, default=3.0)
    parser.add_argument("--flood-lead-s", type=float, default=3.0, help="flood runs alone first")
    parser.add_argument(
        "--short-deadline-requests",
        type=int,
        default=100,
        help="steady requests of the extra contended run with a short deadline (0: skip it)",
    )
    parser.add_argument("--short-deadline-s", type=float, default=2.5)
    parser.add_argument("--calibrate-warm-s", type=float, default=3.0)
    parser.add_argument("--calibrate-s", type=float, default=5.0)
    parser.add_argument("--target", type=float, default=1.2, help="P99 ratio goal")
    parser.add_argument("--budget-s", type=float, default=240.0, help="hard limit, whole run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser.parse_args(argv)


async def bench(args: argparse.Namespace) -> Rig:
    async with contextlib.AsyncExitStack() as stack:
        rig = await open_rig(stack, args)
        slots = args.gpus * args.slots
        clients = slots + slots // 4
        print(f"calibrating: {clients} closed-loop clients over {slots} slots ...", flush=True)
        rig.capacity_rps = await calibrate(
            rig.steady_stubs[0], clients, args.calibrate_warm_s, args.calibrate_s, args.max_tokens
        )
        await settle(rig.tier)
        print(
            f"    C = {rig.capacity_rps:.1f} requests/s; steady at "
            f"{args.steady_share * rig.capacity_rps:.1f}/s, flood at "
            f"{args.flood_x * rig.capacity_rps / 2:.1f}/s",
            flush=True,
        )
        for spec in phase_specs(args):
            print(f"{spec.name}: {spec.steady_requests} steady requests ...", flush=True)
            phase = await run_phase(rig, spec)
            rig.phases.append(phase)
            print(describe(phase), flush=True)
    return rig


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    load_start = os.getloadavg()[0]  # other work on the machine skews every figure here

    async def bounded() -> Rig:
        return await asyncio.wait_for(bench(args), timeout=args.budget_s)

    try:
        rig = asyncio.run(bounded())
    except TimeoutError:
        sys.exit(f"fairness: gave up after --budget-s {args.budget_s:.0f} s (all stopped)")
    info = {
        **machine(),
        **revision(),
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0],
    }
    table = markdown(rig, info, args.target)
    print()
    print(table)
    print(f"(whole run: {time.monotonic() - began:.0f} s)")
    if args.no_write:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fairness.json").write_text(json.dumps(payload(rig, info), indent=2) + "\n")
    (RESULTS / "fairness.md").write_text(table)
    print(f"wrote {RESULTS / 'fairness.json'} and {RESULTS / 'fairness.md'}")


if __name__ == "__main__":
    main()
