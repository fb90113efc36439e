"""How long a fleet takes to start and to stop, with and without compiled bytecode.

Every process ``meridian up`` launches (a GPU worker per zone, a local tier per zone, a
regional tier per region, the global tier) first imports its code.
``cli.launcher.Fleet.start`` launches them all at once, each layer behind a gate
opened when the layer below serves, so the imports overlap; ``Fleet.stop`` stops a layer
at a time, top down. And ``make up`` / ``make test`` compile the project's modules first,
since an environment with ``PYTHONDONTWRITEBYTECODE=1`` (this one) never writes them and
every process would compile every module it imports again.

Each round starts a fleet as ``meridian up`` does (mutual TLS, the demo fleet's settings
cut to a shape), times ``start()`` until every tier serves and ``stop()`` until every
process exited, and reads the CPU its processes and its embedded Redis used
(``RUSAGE_CHILDREN``, once they are reaped). Two ways to find the code, in the same run:

- *bytecode*: the children read ``.pyc`` files ``compileall`` wrote into a cache
  directory of the bench's own (``PYTHONPYCACHEPREFIX``): the project's packages, as
  ``make`` compiles them, and the dependencies';
- *source*: a cache directory with the dependencies' and the interpreter's bytecode
  only (as an installed Python has them), and ``PYTHONDONTWRITEBYTECODE=1``: each child
  compiles the project's modules it imports, as every process did before ``make``
  compiled them first.

Rows alternate within a round and rounds run in alternating order; figures are medians.

    .venv/bin/python -m bench.fleet_start                  # writes results/fleet_start.{json,md}
    .venv/bin/python -m bench.fleet_start --rounds 1 --no-write
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from cli.launcher import DEMO_FLEET, Fleet
from cli.main import SERVING_MODULES
from sim.native import PACKAGES as PROJECT_PACKAGES  # the packages a fleet runs

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
# What a fleet's processes import: the command line, then each one's serving module.
IMPORTED_MODULES = ("cli.main", *SERVING_MODULES.values())
# (regions, GPUs per zone), one zone per region.
SHAPES = {"1 region, 1 zone, 4 GPUs": (1, 4), "2 regions, 1 zone each, 2 GPUs": (2, 2)}
CODE = ("bytecode", "source")


def fleet_file(directory: Path, regions: int, gpus: int) -> Path:
    """The demo fleet cut to ``regions`` regions of one zone of ``gpus`` GPUs, on free ports."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    spec["global"] = {**spec["global"], "listen": "127.0.0.1:0", "ops_listen": "127.0.0.1:0"}
    spec["global"].pop("openai_listen", None)
    spec["regions"] = spec["regions"][:regions]
    spec["auth"]["tenants"] = spec["auth"]["tenants"][:1]  # the other names a region cut here
    for region in spec["regions"]:
        zone = region["zones"][0]
        region["zones"] = [{**zone, "gpus": zone["gpus"][:gpus]}]
    path = directory / f"fleet-{regions}x{gpus}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@contextmanager
def code_from(cache: Path) -> Iterator[None]:
    """Children launched inside find their bytecode in ``cache`` only, and write none."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    os.environ["PYTHONPYCACHEPREFIX"] = str(cache)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def dependency_files() -> list[Path]:
    """The source of every module outside the project a fleet's processes import: a
    child imports each tier's serving module and builds the command line's parser (as
    every ``meridian`` process does, importing what its subcommands need)."""
    imports = " ".join(f"import {m};" for m in IMPORTED_MODULES)
    listing = (
        "import sys; from cli.parser import build_parser; build_parser(); "
        "print('\\n'.join(getattr(m, '__file__', None) or '' for m in list(sys.modules.values())))"
    )
    out = subprocess.run(
        [sys.executable, "-c", imports + listing],
        cwd=ROOT, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout  # fmt: skip
    ours = {ROOT / package for package in PROJECT_PACKAGES}
    return sorted(
        path
        for path in {Path(f) for f in out.split() if f.endswith(".py")}
        if not any(path.is_relative_to(package) for package in ours)
    )


def project_files() -> list[Path]:
    """What ``make`` compiles of the code a fleet runs (the Makefile's ``BYTECODE``)."""
    return sorted(p for package in PROJECT_PACKAGES for p in (ROOT / package).rglob("*.py"))


def compile_into(cache: Path, files: list[Path]) -> None:
    """``files`` compiled into ``cache``, where a child with ``code_from(cache)`` looks."""
    before, sys.pycache_prefix = sys.pycache_prefix, str(cache)
    try:
        for path in files:
            compileall.compile_file(path, quiet=2)
    finally:
        sys.pycache_prefix = before


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_fleet(path: Path, run_dir: Path) -> dict[str, float]:
    """Start and stop one fleet: seconds each, and its processes' CPU seconds."""
    fleet = Fleet(path, run_dir)
    cpu = children_cpu_s()
    started = time.monotonic()
    try:
        fleet.start(timeout_s=120)
        up = time.monotonic()
    finally:
        stopping = time.monotonic()
        fleet.stop()
    down = time.monotonic()
    return {
        "start_s": up - started,
        "stop_s": down - stopping,
        "processes": len(fleet.processes),
        "cpu_s": children_cpu_s() - cpu,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        shape: {code: [] for code in CODE} for shape in SHAPES
    }
    with tempfile.TemporaryDirectory(prefix="fleet-start-") as tmp:
        work = Path(tmp)
        caches = {"bytecode": work / "pyc", "source": work / "deps-only"}
        # Both find the interpreter's and the dependencies' bytecode (an installed
        # Python has it); only "bytecode" has the project's.
        dependencies = dependency_files()
        compile_into(caches["bytecode"], dependencies + project_files())
        compile_into(caches["source"], dependencies)
        fleets = {shape: fleet_file(work, *dims) for shape, dims in SHAPES.items()}
        rows = [(shape, code) for shape in SHAPES for code in CODE]
        for n in range(args.rounds):
            for i, (shape, code) in enumerate(rows if n % 2 == 0 else rows[::-1]):
                with code_from(caches[code]):
                    sample = one_fleet(fleets[shape], work / f"run-{n}-{i}")
                samples[shape][code].append(sample)
                print(
                    f"round {n + 1}/{args.rounds} {shape}, {code}: start {sample['start_s']:.2f} s,"
                    f" stop {sample['stop_s']:.2f} s, CPU {sample['cpu_s']:.1f} s",
                    flush=True,
                )
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average": os.getloadavg(),
        "rounds": args.rounds,
        "samples": samples,
        "medians": {
            shape: {
                code: {
                    key: statistics.median(s[key] for s in samples[shape][code])
                    for key in ("start_s", "stop_s", "cpu_s", "processes")
                }
                for code in CODE
            }
            for shape in SHAPES
        },
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Fleet start and stop (`python -m bench.fleet_start`)",
        "",
        f"{result['when']}, {result['machine']['cpus']} cores, Python "
        f"{result['machine']['python']}, {result['rounds']} rounds (medians), load average "
        f"at the end {result['load_average'][0]:.1f}. *bytecode*: the children read compiled "
        "modules (what `make up` / `make test` prepare); *source*: they compile the project's "
        "modules they import (the dependencies' bytecode is there in both). *CPU*: all the "
        "fleet's processes and its embedded Redis, start to exit.",
        "",
        "| fleet | processes (+ Redis) | code | start s | stop s | CPU s | start ÷ source's |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for shape, by_code in result["medians"].items():
        source = by_code["source"]["start_s"]
        for code, m in by_code.items():
            lines.append(
                f"| {shape} | {m['processes']:.0f} | {code} | {m['start_s']:.2f} | "
                f"{m['stop_s']:.2f} | {m['cpu_s']:.1f} | {m['start_s'] / source:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = run(args)
    text = report(result)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fleet_start.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "fleet_start.md").write_text(text)


if __name__ == "__main__":
    main()
