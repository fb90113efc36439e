"""``meridian sim``: write a fleet topology, or simulate policies on a fleet in simulated time.

meridian sim fleet --gpus 1024 --regions 6 [--seed 1] [--out fleet.yaml]
meridian sim run [--fleet fleet.yaml | --gpus 1024 --regions 6] [--workload conversation]
                 [--scenarios steady-90,flash-crowd] [--policies meridian,round_robin,bound]
                 [--requests 200000] [--seed 1] [--jobs 2] [--out bench/results/fleet] [--quick]
                 [--native]

Every policy of a run sees the same arrivals and the same failures. Runs go to
``--jobs`` worker processes (one simulation per process at a time); results are
written as JSON, Markdown and PNG plots to ``--out``. ``--native`` runs the copy
``make sim-native`` compiled (``sim.native``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from cli.options import HelpFormatter
from common.config.node import ConfigError
from common.config.topology import Topology, load_topology, topology_from_mapping
from common.observability.logs import LEVEL_ENV, LogSettings
from sim.caps import parse_caps
from sim.native import NativeError, compiled_modules, run_native

if TYPE_CHECKING:
    from sim.regional_load import RegionalLoad
    from sim.run import RunSpec

QUICK = {"gpus": 48, "regions": 3, "requests": 2500}
# The simulated tiers log as the servers do. In a simulation their warnings (a GPU
# ejected, a zone marked down) are the scenario's own events, which its results and
# timelines already show; hundreds of them would bury the progress bar.
# MERIDIAN_LOG_LEVEL, when set, still wins.
SIM_LOG_LEVEL = "error"
DEFAULT_OUT = "bench/results/fleet"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meridian sim",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="action", required=True)
    what = "write a fleet topology YAML"
    fleet = sub.add_parser("fleet", help=what, description=what, formatter_class=HelpFormatter)
    _fleet_options(fleet)
    fleet.add_argument("--out", help="where to write it (default: standard output)")
    what = "simulate policies on a fleet and write the results"
    run = sub.add_parser("run", help=what, description=what, formatter_class=HelpFormatter)
    _fleet_options(run)
    run.add_argument("--fleet", help="a topology YAML to simulate instead of a generated fleet")
    _workload_options(run)
    run.add_argument("--scenarios", default="all", help="comma-separated names, or 'all'")
    run.add_argument(
        "--policies",
        default="all",
        help="comma-separated names, or 'all'; a spill stack takes its threshold as name@0.5",
    )
    run.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"arrivals per run (default: 200000; {QUICK['requests']} with --quick)",
    )
    run.add_argument("--jobs", type=int, default=2, help="simulations run at once (processes)")
    run.add_argument("--out", default=DEFAULT_OUT, help="results directory")
    run.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds")
    run.add_argument("--slo-e2e", type=float, default=20.0, help="end-to-end SLO in seconds")
    run.add_argument(
        "--propagation-ms",
        type=float,
        default=50.0,
        help="delay from a summary's publication to its reader, in ms",
    )
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    run.add_argument(
        "--native",
        action="store_true",
        help="run the copy `make sim-native` compiled with mypyc (same results, ~1.4x faster)",
    )
    run.add_argument(
        "--quick",
        action="store_true",
        help=f"a small preset for tests: {QUICK['gpus']} GPUs, {QUICK['regions']} regions, "
        f"{QUICK['requests']} requests per run",
    )
    return parser


def _workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="conversation",
        help="conversation, code, or a CSV trace in the Azure format",
    )
    p.add_argument(
        "--max-tokens",
        default="default",
        help="how clients set max_tokens: 'default' (a mix of none, 256, 1024 and 4096), "
        "a number, 'none' (the server's limit), a mix such as 'none:0.5,1024:0.5', or "
        "'exact' (each asks for its answer's true length: clairvoyant, a reference only)",
    )
    p.add_argument(
        "--models",
        default=None,
        help="the models requests ask for, as 'name:weight,...' (default: every model the "
        "topology serves, by its GPU count); each must be served by the topology",
    )


def _fleet_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=1024, help="GPUs in the fleet")
    p.add_argument("--regions", type=int, default=6, help="cloud regions")
    p.add_argument("--seed", type=int, default=1, help="random seed")
    p.add_argument(
        "--sized-to-demand",
        action="store_true",
        help="split the GPUs over regions by their clients' peak demand over a day "
        "(default: by each region's usual size)",
    )


def sim_main(argv: list[str], out: TextIO = sys.stdout) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.action == "fleet":
            return _fleet(args, out)
        if args.native:
            return run_native([a for a in argv if a != "--native"])
        return _run(args, out)
    except (ValueError, ConfigError, NativeError) as exc:
        print(f"meridian sim: {exc}", file=sys.stderr)
        return 2


def _fleet(args: argparse.Namespace, out: TextIO) -> int:
    from sim.fleet_gen import fleet_mapping, write_fleet

    mapping = fleet_mapping(
        gpus=args.gpus, regions=args.regions, seed=args.seed, sized_to_demand=args.sized_to_demand
    )
    if args.out:
        write_fleet(Path(args.out), mapping)
        print(f"wrote {args.out}: {args.gpus} GPUs in {args.regions} regions", file=out)
    else:
        import yaml

        out.write(yaml.safe_dump(mapping, sort_keys=False))
    return 0


def _topology(args: argparse.Namespace) -> Topology:
    if args.fleet and args.sized_to_demand:
        raise ValueError("--sized-to-demand shapes a generated fleet: drop it or --fleet")
    if args.fleet:
        topology = load_topology(args.fleet)
    else:
        from sim.fleet_gen import fleet_mapping

        topology = topology_from_mapping(
            fleet_mapping(
                gpus=args.gpus,
                regions=args.regions,
                seed=args.seed,
                sized_to_demand=args.sized_to_demand,
            )
        )
    if not any(z.gpus for r in topology.regions for z in r.zones):
        raise ValueError("the fleet has no GPUs: give every zone at least one")
    return topology


def _names(text: str, known: list[str], what: str) -> list[str]:
    if text == "all":
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n.partition("@")[0] not in known]
    if unknown or not names:
        raise ValueError(f"--{what}: unknown {what} {unknown or text!r}; known: {', '.join(known)}")
    return names


def _policies(text: str) -> list[str]:
    """The ``--policies`` named, each checked (a spill threshold too) before any run."""
    from sim.bound import BOUND
    from sim.policies import POLICY_SETS, policy_set

    policies = _names(text, [*POLICY_SETS, BOUND], "policies")
    for name in policies:
        if name != BOUND:
            policy_set(name)
    return policies


def _run(args: argparse.Namespace, out: TextIO) -> int:
    from cli.sim_progress import simulate
    from sim.deployment import SimSettings
    from sim.measure import Slo
    from sim.report import RunResults, ScenarioResult, write_results
    from sim.run import Geography, RunSpec, scenario_workload
    from sim.scenarios import SCENARIOS

    if args.quick:
        args.gpus, args.regions = QUICK["gpus"], QUICK["regions"]
    if args.requests is None:
        args.requests = QUICK["requests"] if args.quick else 200_000
    if args.requests < 1:
        raise ValueError(f"--requests must be at least 1, got {args.requests}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    policies = _policies(args.policies)
    scenarios = [
        s
        for s in SCENARIOS
        if s.name in _names(args.scenarios, [s.name for s in SCENARIOS], "scenarios")
    ]
    topology = _topology(args)
    workload, trace = _workload(args.workload, args.seed)
    workload = replace(workload, caps=parse_caps(args.max_tokens), models=_models(args.models))
    base = RunSpec(
        topology=topology,
        workload=workload,
        scenario=scenarios[0],
        policy=policies[0],
        requests=args.requests,
        seed=args.seed,
        trace=trace,
        settings=SimSettings(propagation_s=args.propagation_ms / 1000.0),
        slo=Slo(ttft_s=args.slo_ttft, e2e_s=args.slo_e2e),
    )
    scenario_workload(base, Geography(topology))  # a model no GPU serves fails here, at once
    specs = [replace(base, scenario=s, policy=p) for s in scenarios for p in policies]
    started = time.monotonic()
    with tiers_logging_at(sim_log_level(os.environ)):
        results = simulate(specs, args.jobs, out)
    run = RunResults(
        meta=_meta(args, topology, policies, time.monotonic() - started),
        scenarios=[
            ScenarioResult(
                name=s.name,
                description=s.description,
                load=s.load,
                events=results[(s.name, policies[0])][1],
                policies={p: results[(s.name, p)][0] for p in policies},
                regional_load=_regional_load(replace(base, scenario=s)),
            )
            for s in scenarios
        ],
    )
    for path in write_results(Path(args.out), run, plots=not args.no_plots):
        print(f"wrote {path}", file=out)
    return 0


def _regional_load(spec: RunSpec) -> RegionalLoad | None:
    """Each region's offered load ÷ capacity over the run, from the workload alone;
    None for a trace replay (its arrivals carry no cities to map to regions)."""
    from sim.regional_load import regional_load
    from sim.run import Geography, scenario_workload

    if spec.trace is not None:
        return None
    workload = scenario_workload(spec, Geography(spec.topology))
    return regional_load(workload, spec.topology, spec.requests / workload.rate_rps)


def sim_log_level(env: Mapping[str, str]) -> str:
    """``MERIDIAN_LOG_LEVEL`` when set (a bad value: ValueError naming it), else
    ``SIM_LOG_LEVEL``."""
    settings = LogSettings.from_env(env)
    return settings.level if env.get(LEVEL_ENV, "").strip() else SIM_LOG_LEVEL


@contextmanager
def tiers_logging_at(level: str) -> Iterator[None]:
    """The root logger at ``level`` while the runs last (worker processes fork inside,
    so they inherit it), as it was afterwards: ``sim_main`` may run in a caller's
    process."""
    root = logging.getLogger()
    before = root.level
    root.setLevel(level.upper())
    try:
        yield
    finally:
        root.setLevel(before)


def _models(text: str | None) -> tuple[tuple[str, float], ...]:
    """``--models``: ``name:weight`` pairs (a weight left out is 1); () when not given."""
    if text is None:
        return ()
    out = []
    for part in text.split(","):
        name, _, weight = part.strip().partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--models: {part.strip()!r} is not NAME[:WEIGHT]") from None
        if not name or not value > 0:
            raise ValueError(f"--models: {part.strip()!r} needs a name and a weight > 0")
        out.append((name, value))
    return tuple(out)


def _workload(name: str, seed: int) -> tuple[Any, Path | None]:
    from sim.shapes import CODE, CONVERSATION
    from sim.workload import WorkloadSpec

    shapes = {"conversation": CONVERSATION, "code": CODE}
    if name in shapes:
        return WorkloadSpec(shape=shapes[name], seed=seed), None
    path = Path(name)
    if path.suffix.lower() != ".csv" or not path.is_file():
        raise ValueError(f"--workload: {name!r} is neither conversation, code nor a CSV file")
    return WorkloadSpec(seed=seed), path


def _meta(
    args: argparse.Namespace, topology: Topology, policies: list[str], wall_s: float
) -> dict[str, Any]:
    gpus = [g for r in topology.regions for z in r.zones for g in z.gpus]
    return {
        "gpus": len(gpus),
        "regions": [r.name for r in topology.regions],
        "zones": sum(len(r.zones) for r in topology.regions),
        "workload": args.workload,
        "max_tokens": parse_caps(args.max_tokens).label,
        "models": args.models or "every model the topology serves, by GPU count",
        "requests_per_run": args.requests,
        "seed": args.seed,
        "policies": policies,
        "wall_s": round(wall_s, 1),
        # Modules run compiled (``--native``): the wall time depends on it, nothing else.
        "compiled_modules": len(compiled_modules()),
        "jobs": args.jobs,
        "propagation_ms": args.propagation_ms,
        "summary_cadence_s": topology.summary_cadence_s,
        "summary_ttl_s": topology.summary_ttl_s,
    }
