"""Run a benchmark in two checkouts, alternating, in one run: before and after a change.

Each round runs ``python -m bench.NAME ARGS`` first in the ``--before`` checkout (for example
``git worktree add /tmp/before <commit>``), then in this one, and reads back the JSON each
wrote to its own ``bench/results/``. Alternating spreads the machine's noise over both sides;
the report gives each side's figures per round and their medians. Writes
``bench/results/before_after_<NAME>.json``.

    .venv/bin/python -m bench.before_after --before /tmp/before --bench pick_time \\
        --rounds 3 -- --sizes 64,4096 --policies default --picks 5000
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def pick_time(result: dict[str, Any]) -> dict[str, float]:
    cells = {(c["n_gpus"], c["policy"]): c["median_us"] for c in result["cells"]}
    return {f"{policy} median us @{n}": us for (n, policy), us in sorted(cells.items())}


def tracing_overhead(result: dict[str, Any]) -> dict[str, float]:
    return {
        "off rps": result["median_rps"]["off"],
        "on rps": result["median_rps"]["on"],
        "CPU added % (all traced)": result["paired_cpu_added_pct"]["on"]["median"],
        "CPU added % (10 % sampled)": result["paired_cpu_added_pct"]["10%"]["median"],
    }


def fairness(result: dict[str, Any]) -> dict[str, float]:
    return {
        "steady P99 contended / alone": result["p99_ratio_contended_vs_alone"],
        "VTC only / alone": result["p99_ratio_vtc_only_vs_alone"],
        "FIFO / alone": result["p99_ratio_no_fairness_vs_alone"],
    }


FIGURES: dict[str, Callable[[dict[str, Any]], dict[str, float]]] = {
    "pick_time": pick_time,
    "tracing_overhead": tracing_overhead,
    "fairness": fairness,
}


def run_once(checkout: Path, bench: str, args: list[str]) -> dict[str, float]:
    python = ROOT / ".venv" / "bin" / "python"
    subprocess.run(
        [str(python if python.exists() else sys.executable), "-m", f"bench.{bench}", *args],
        cwd=checkout,
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=900,
    )
    result = json.loads((checkout / "bench" / "results" / f"{bench}.json").read_text())
    return FIGURES[bench](result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--bench", choices=sorted(FIGURES), required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("args", nargs="*", help="passed to the benchmark (after --)")
    opts = parser.parse_args()
    sides: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(opts.rounds):
        for side, checkout in (("before", opts.before), ("after", ROOT)):
            figures = run_once(checkout, opts.bench, opts.args)
            sides[side].append(figures)
            print(
                f"round {i + 1} {side:6s} " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
            )
    medians = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for side, runs in sides.items()
    }
    print("medians:")
    for key in medians["after"]:
        before, after = medians["before"][key], medians["after"][key]
        ratio = after / before if before else float("nan")
        print(f"  {key:32s} before {before:9.2f}  after {after:9.2f}  after/before {ratio:.2f}")
    out = ROOT / "bench" / "results" / f"before_after_{opts.bench}.json"
    out.write_text(
        json.dumps({"args": opts.args, "rounds": sides, "medians": medians}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
