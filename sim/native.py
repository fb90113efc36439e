"""The simulator's hot path compiled with mypyc, for runs of a million requests.

A simulated request runs the servers' own decision code (pickers, balancers, the
local tier's state) plus the GPU model and the simulated event loop: ~450 µs of
CPython per request, flat across ~30 modules, so a million requests took over
7 minutes on this machine. ``make sim-native`` copies the project's packages to
``.sim-native/`` and compiles ``NATIVE_MODULES`` there with mypyc (it ships with
mypy, a dev dependency; it needs a C compiler). ``meridian sim run --native`` then
runs the simulation in a child whose imports come from that copy: the same
source, compiled, so the same seed gives the same results to the digit
(``tests/sim/test_native.py``), and the servers and tests keep importing the
plain modules. A copy built from other sources than the checkout's is refused.

    python -m sim.native [--out .sim-native]      # what `make sim-native` runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".sim-native"
# The packages a simulation imports, copied whole; the compiled ones replace their
# .py in the copy (an extension module is found before source in the same folder).
PACKAGES = ("cli", "common", "global_lb", "local_lb", "regional_lb", "sim")
# What a run spends its time in (a profile of 1024 GPUs at steady 90 %), every
# module of it compiled together. Left out: modules whose classes leave an init=False
# field to its default (mypyc leaves it unset: local_lb.publication) or give
# instances attributes the class does not declare (common.basics.geo), frozen
# classes that are pickled or copied (sim.shapes, common.config: a compiled frozen
# class cannot be unpickled), async generators (sim.engine), and cold modules.
NATIVE_MODULES = (
    "common/basics/sampling.py",
    "common/capacity/summary.py",
    "common/request/balancer.py",
    "common/request/child.py",
    "common/request/forwarding.py",
    "common/request/output_length.py",
    "common/request/per_try.py",
    "common/request/pick.py",
    "common/request/routing.py",
    "global_lb/picker.py",
    "local_lb/balancer.py",
    "local_lb/cost.py",
    "local_lb/handoff.py",
    "local_lb/learning.py",
    "local_lb/load_book.py",
    "local_lb/picker.py",
    "local_lb/queue.py",
    "local_lb/readiness.py",
    "local_lb/resilience.py",
    "local_lb/session.py",
    "local_lb/slots.py",
    "local_lb/state.py",
    "local_lb/tenancy.py",
    "regional_lb/picker.py",
    "sim/clock.py",
    "sim/deployment.py",
    "sim/flow.py",
    "sim/gpu_model.py",
    "sim/measure.py",
    "sim/prefix_cache.py",
    "sim/publishing.py",
    "sim/run.py",
    "sim/sessions.py",
    "sim/workload.py",
)
MANIFEST = "manifest.json"
# Where `meridian sim run --native` looks for the compiled copy (default DEFAULT_DIR).
NATIVE_DIR_ENV = "MERIDIAN_SIM_NATIVE_DIR"


class NativeError(Exception):
    """No usable compiled copy; the message says what to run."""


def source_digest(root: Path = ROOT) -> str:
    """SHA-256 over every .py file of ``PACKAGES`` under ``root`` and pyproject.toml."""
    digest = hashlib.sha256()
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    for path in [*files, root / "pyproject.toml"]:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def build(dest: Path = DEFAULT_DIR, modules: Sequence[str] = NATIVE_MODULES) -> Path:
    """Copy the packages to ``dest`` and compile ``modules`` there; returns ``dest``."""
    if dest.exists() and any(dest.iterdir()) and not _built_here(dest):
        raise NativeError(f"{dest} is not empty and holds no compiled simulator: not replacing it")
    compiler = sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        raise NativeError(f"mypyc needs a C compiler and {compiler!r} was not found")
    digest = source_digest()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")  # mypy's settings
    done = subprocess.run(
        [sys.executable, "-m", "mypyc", *modules],
        cwd=dest,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        (dest / "build.log").write_text(done.stdout + done.stderr)
        errors = [line for line in done.stdout.splitlines() if ": error:" in line]
        raise NativeError(
            "mypyc failed (" + "; ".join(errors[:3] or ["see " + str(dest / "build.log")]) + ")"
        )
    manifest = {"sources": digest, "modules": list(modules), "python": sys.version}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


def _built_here(dest: Path) -> bool:
    """``dest`` holds a build of this module's (finished or not), safe to replace."""
    return (dest / MANIFEST).exists() or (dest / "sim" / "native.py").exists()


def check(dest: Path) -> Path:
    """``dest`` if it holds a compiled copy of the checkout's current sources."""
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        raise NativeError(f"no compiled simulator in {dest}: run `make sim-native`") from None
    if manifest.get("python") != sys.version:
        raise NativeError(f"{dest} was built for another Python: run `make sim-native`")
    if manifest.get("sources") != source_digest():
        raise NativeError(
            f"the sources changed since {dest} was built: run `make sim-native` again"
        )
    return dest


def native_dir() -> Path:
    """Where the compiled copy is: ``$MERIDIAN_SIM_NATIVE_DIR``, else ``.sim-native``."""
    return Path(os.environ.get(NATIVE_DIR_ENV) or DEFAULT_DIR)


def run_native(argv: Sequence[str], dest: Path | None = None) -> int:
    """``meridian sim <argv>`` in a child importing from the compiled copy; its exit code."""
    where = str(check(dest or native_dir()))
    boot = f"import sys; sys.path.insert(0, {where!r}); from cli.main import main; main()"
    return subprocess.call([sys.executable, "-c", boot, "sim", *argv])


def compiled_modules() -> list[str]:
    """Which of ``NATIVE_MODULES`` this process runs compiled (for a run's results)."""
    names = [m.removesuffix(".py").replace("/", ".") for m in NATIVE_MODULES]
    loaded = (sys.modules.get(n) for n in names)
    return [n for n, mod in zip(names, loaded, strict=True) if _is_extension(mod)]


def _is_extension(module: object) -> bool:
    path = getattr(module, "__file__", None) or ""
    return path.endswith(tuple(EXTENSION_SUFFIXES))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="where to build")
    args = parser.parse_args(argv)
    try:
        dest = build(args.out)
    except NativeError as exc:
        print(f"sim.native: {exc}", file=sys.stderr)
        return 1
    print(f"compiled {len(NATIVE_MODULES)} modules into {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
