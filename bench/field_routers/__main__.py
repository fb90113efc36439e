"""``python -m bench.field_routers``: run the bench, print the table, write the results.

.venv/bin/python -m bench.field_routers                  # the recorded run
.venv/bin/python -m bench.field_routers --quick --no-write
.venv/bin/python -m bench.field_routers --fronts meridian,smg --workloads stream
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.field_routers.fronts import ALL_FRONTS, ROUTERS_VENV, RUST, Stage, load_average
from bench.field_routers.report import aggregate, finite, markdown
from bench.field_routers.run import Plan, idle_cores, run_rounds
from bench.field_routers.workload import Shape, capacity_rps, mean_new_tokens, schedule
from bench.report import machine, revision
from common.config.gpu import HARDWARE_SPEED

RESULTS = Path(__file__).resolve().parent.parent / "results"
WORKLOADS = {"stream": 1.0, "unary": 0.0, "mixed": 0.5}
SLOTS = 16  # the emulated GPU's default max_concurrency (the fleet file sets none)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.field_routers", description=__doc__)
    p.add_argument("--fronts", default=",".join(ALL_FRONTS), help="comma-separated")
    p.add_argument("--workloads", default="stream,unary", help=f"of {','.join(WORKLOADS)}")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=20.0, help="emulated GPU slowness")
    p.add_argument(
        "--load",
        type=float,
        default=0.5,
        help="of the GPUs' computed capacity, which assumes every shared prefix and earlier "
        "turn cached: at the 0.45-0.65 prefix hit shares the routers reach, 0.5 is about 85 %% "
        "of what the GPUs serve and 0.85 overloads every front",
    )
    p.add_argument("--seconds", type=float, default=None, help="arrivals per window (40)")
    p.add_argument("--max-requests", type=int, default=2000, help="per window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=32)
    p.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU sampling")
    p.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="OpenAI route (chat: SMG and sglang-router send max_tokens as "
        "max_completion_tokens, which the emulated GPU reads as vLLM does)",
    )
    p.add_argument("--quick", action="store_true", help="1 round of 10 s windows (a look)")
    p.add_argument(
        "--routers-venv",
        type=Path,
        default=ROUTERS_VENV,
        help="the Rust routers' virtualenv (made by `make routers` when absent)",
    )
    p.add_argument("--out", default="field_routers", help="results/OUT.json and OUT.md")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
    if args.seconds is None:
        args.seconds = 10.0 if args.quick else 40.0
    return args


def plan_for(args: argparse.Namespace) -> tuple[Plan, dict[str, Any]]:
    """The windows' shape at ``--load`` of the capacity the GPUs' cost model gives."""
    probe = Shape(rate_rps=10.0, seconds=600.0)
    turns = schedule(probe, args.seed)
    out = (probe.output_tokens[0] + probe.output_tokens[1]) / 2
    new = mean_new_tokens(turns)
    cap = capacity_rps(args.gpus, HARDWARE_SPEED["H100"], SLOTS, args.time_scale, out, new)
    rate = args.load * cap
    shape = Shape(rate_rps=rate, seconds=args.seconds, max_requests=args.max_requests)
    workloads = {w: WORKLOADS[w] for w in args.workloads.split(",")}
    plan = Plan(shape, workloads, args.rounds, args.seed, args.timeout, args.api)
    info = {
        "capacity_rps": cap,
        "rate_rps": rate,
        "mean_output_tokens": out,
        "mean_uncached_prompt_tokens": new,
        "mean_prompt_tokens": sum(t.prompt_words for t in turns) / len(turns),
        "mean_turns_per_conversation": len(turns) / len({t.conversation for t in turns}),
    }
    return plan, info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the table, write the results unless ``--no-write``; the result."""
    args = parse_args(argv)
    plan, load_info = plan_for(args)
    print(f"offered load: {json.dumps(load_info)}", flush=True)
    fronts = args.fronts.split(",")
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="field-routers-") as tmp:
        stage = Stage(Path(tmp), args.gpus, args.time_scale, fronts, args.routers_venv)
        try:
            stage.start()
            for name, why in stage.missing.items():
                print(f"{name}: {why}", file=sys.stderr, flush=True)
            idle = idle_cores(stage, [f for f in fronts if f in stage.available], args.idle)
            print(f"idle cores: {json.dumps(idle)}", flush=True)
            rows = run_rounds(stage, plan, idle)
        finally:
            stage.stop()
    result = {
        "command": "python -m bench.field_routers " + " ".join(argv or sys.argv[1:]),
        "machine": {**machine(), "load_start": load_start, "load_end": load_average()},
        "revision": revision(),
        "args": {**vars(args), "routers_venv": str(args.routers_venv)},
        "load": load_info,
        "shape": plan.shape.__dict__,
        "workloads": plan.workloads,
        "fronts": fronts,
        "missing": stage.missing,
        "idle_cores": idle,
        "rust": list(RUST),
        "summary": aggregate(rows, fronts),
        "windows": rows,
    }
    text = markdown(result)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(finite(result), indent=1) + "\n")
        (RESULTS / f"{args.out}.md").write_text(text)
    return result


if __name__ == "__main__":
    main()
