"""What the local tier's per-try timeout costs at fleet scale (issue 11).

The fleet simulator on the generated 1024-GPU, 6-region fleet at steady 90 %, Meridian's
policy, the same arrivals for every setting of the topology's
``liveness.per_try_timeout``: the default (1 s + 4 × expected), two looser ones and off.
Prints e2e P99 and goodput per setting and writes ``bench/results/per_try_sweep.{json,md}``.
Simulated time: the figures do not depend on the machine's speed or load, only the wall
time does.

    .venv/bin/python -m bench.per_try_sweep                     # 100 000 requests a run
    .venv/bin/python -m bench.per_try_sweep --gpus 128 --regions 4 --requests 30000 --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from bench.report import machine, revision
from common.config.liveness import PerTryTimeout
from common.config.topology import Topology, topology_from_mapping
from sim.fleet_gen import fleet_mapping
from sim.run import RunSpec, run
from sim.scenarios import scenario
from sim.workload import WorkloadSpec

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS: tuple[tuple[str, PerTryTimeout], ...] = (
    ("default (1 s + 4 × expected)", PerTryTimeout()),
    ("5 s + 4 ×", PerTryTimeout(floor_s=5.0)),
    ("2 s + 8 ×", PerTryTimeout(floor_s=2.0, multiple=8.0)),
    ("off", PerTryTimeout(enabled=False)),
)


def with_per_try(topo: Topology, per_try: PerTryTimeout) -> Topology:
    liveness = dataclasses.replace(topo.liveness, per_try_timeout=per_try)
    return dataclasses.replace(topo, liveness=liveness)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--regions", type=int, default=6)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--scenario", default="steady-90")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    fleet = topology_from_mapping(fleet_mapping(gpus=args.gpus, regions=args.regions, seed=1))
    rows = []
    for label, per_try in SETTINGS:
        started = time.perf_counter()
        spec = RunSpec(
            topology=with_per_try(fleet, per_try),
            workload=WorkloadSpec(seed=1),
            scenario=scenario(args.scenario),
            policy="meridian",
            requests=args.requests,
            seed=1,
        )
        result = run(spec)
        row = {
            "per_try_timeout": label,
            "e2e_p99_s": result.e2e_p99_s,
            "goodput": result.goodput,
            "wall_s": round(time.perf_counter() - started, 1),
        }
        rows.append(row)
        p99 = result.e2e_p99_s or float("nan")
        goodput = 100 * (result.goodput or 0.0)
        print(f"{label:30s} e2e P99 {p99:6.2f} s  goodput {goodput:5.1f} %", flush=True)
    if args.no_write:
        return
    meta = {**vars(args), "machine": machine(), "revision": revision()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "per_try_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"# Per-try timeout at {args.gpus} GPUs, {args.scenario}, {args.requests} requests",
        "",
        "| per-try timeout | e2e P99 | goodput |",
        "|:---|---:|---:|",
        *(
            f"| {r['per_try_timeout']} | {r['e2e_p99_s']:.1f} s | {100 * r['goodput']:.1f} % |"
            for r in rows
        ),
    ]
    (RESULTS / "per_try_sweep.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
