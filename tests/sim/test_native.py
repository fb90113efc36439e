"""``make sim-native`` / ``meridian sim run --native``: the same source compiled, the same results.

The build compiles a few of ``NATIVE_MODULES`` (all of them take over a minute),
among them the simulated event loop, the GPU model and the local tier's cost.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from cli.sim import sim_main
from sim.native import (
    MANIFEST,
    NATIVE_DIR_ENV,
    NATIVE_MODULES,
    ROOT,
    NativeError,
    build,
    check,
    run_native,
)

SOME_MODULES = ("sim/clock.py", "sim/gpu_model.py", "local_lb/cost.py")
RUN = ["run", "--quick", "--scenarios", "zone-then-region-lost", "--policies", "meridian",
       "--requests", "800", "--jobs", "1", "--no-plots"]  # fmt: skip
# What depends on the machine and the build, not on what was simulated.
NOT_COMPARED = {"wall_s", "sim_wall_s", "compiled_modules"}


def _compiler() -> bool:
    cc = sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0]) is not None


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _compiler():
        pytest.skip("mypyc needs a C compiler")
    return build(tmp_path_factory.mktemp("native") / "copy", SOME_MODULES)


def _figures(path: Path) -> Any:
    """A results file without what depends on the machine (wall times, compilation)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in NOT_COMPARED}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(json.loads(path.read_text()))


def test_the_compiled_copy_gives_the_plain_runs_results(native: Path, tmp_path: Path) -> None:
    assert run_native([*RUN, "--out", str(tmp_path / "native")], native) == 0
    assert sim_main([*RUN, "--out", str(tmp_path / "plain")]) == 0
    compiled = json.loads((tmp_path / "native" / "fleet.json").read_text())
    assert compiled["meta"]["compiled_modules"] == len(SOME_MODULES)
    plain = _figures(tmp_path / "plain" / "fleet.json")
    assert plain["scenarios"][0]["policies"]["meridian"]["served"] > 0
    assert _figures(tmp_path / "native" / "fleet.json") == plain


def test_the_copy_runs_its_compiled_modules(native: Path) -> None:
    probe = (
        f"import sys; sys.path.insert(0, {str(native)!r}); "
        "import sim.clock, sim.flow; from sim.native import compiled_modules; "
        "print(sorted(compiled_modules()))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["local_lb.cost", "sim.clock", "sim.gpu_model"])


def test_a_copy_of_other_sources_is_refused(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text(
        json.dumps({"sources": "0" * 64, "modules": [], "python": sys.version})
    )
    with pytest.raises(NativeError, match=r"sources changed.*make sim-native"):
        check(tmp_path)


def test_native_without_a_build_exits_2_and_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(NATIVE_DIR_ENV, str(tmp_path / "nothing-here"))
    assert sim_main([*RUN, "--out", str(tmp_path / "out"), "--native"]) == 2
    err = capsys.readouterr().err
    assert "no compiled simulator in" in err and "make sim-native" in err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_build_never_replaces_a_folder_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(NativeError, match="not empty and holds no compiled simulator"):
        build(tmp_path, SOME_MODULES)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_no_compiled_module_defines_a_named_function_inside_another() -> None:
    """Compiled, a function defined inside another is kept in the outer one's
    environment, which the inner one holds: a cycle per call, left for the cyclic GC
    that a simulated run switches off (per attempt in ``within_per_try``, per request
    in the completion-time picker, ~1.1 GB over a million requests). Lambdas are not
    kept there. Only ``sim.publishing.every``'s, made once per periodic task, is left."""
    nested = []
    for path in NATIVE_MODULES:
        for outer in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef):
                nested += [
                    (path, outer.name, inner.name)
                    for inner in ast.walk(outer)
                    if inner is not outer
                    and isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
    assert nested == [("sim/publishing.py", "every", "run")]
