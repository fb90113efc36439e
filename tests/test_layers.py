"""The structure the README's "How it is built" promises, checked on every run.

Imports point one way: inside ``common`` a room imports only rooms below it;
``common`` never imports a tier, the simulator or the command line; tiers never
import each other; nothing imports ``cli`` but ``cli`` and the benchmarks, and
nothing imports a benchmark. The module graph has no cycle, and no module or
function outside tests and generated code (benchmarks included) outgrows the size
a reader can hold (400 lines, 60 lines).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "global_lb", "regional_lb", "local_lb", "sim", "cli", "bench")
# Bottom first: a room may import itself and the rooms before it.
ROOMS = (
    "gen",
    "basics",
    "config",
    "capacity",
    "request",
    "tenancy",
    "observability",
    "operations",
    "tier",
)
TIERS = ("global_lb", "regional_lb", "local_lb")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "gen" in path.relative_to(ROOT).parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def imported(path: Path) -> set[str]:
    """Every first-party module ``path`` imports (TYPE_CHECKING imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from common.x import y`` may name a module y: count both.
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


GRAPH = {name: imported(path) for name, path in modules()}
KNOWN = set(GRAPH)


def edges(name: str) -> set[str]:
    return {m for m in GRAPH[name] if m in KNOWN and m != name}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_common_never_imports_a_tier_the_simulator_or_the_cli() -> None:
    bad = [
        (m, i)
        for m in GRAPH
        if m.startswith("common")
        for i in GRAPH[m]
        if not i.startswith("common")
    ]
    assert bad == []


def test_rooms_of_common_import_only_downwards() -> None:
    bad = []
    for m in GRAPH:
        if not m.startswith("common.") or room(m) not in ROOMS:
            continue
        for i in GRAPH[m]:
            if i.startswith("common.") and ROOMS.index(room(i)) > ROOMS.index(room(m)):
                bad.append(f"{m} -> {i}")
    assert bad == []


def test_every_module_of_common_is_in_a_room() -> None:
    assert [m for m in GRAPH if m.startswith("common.") and room(m) not in ROOMS] == []


def test_tiers_never_import_each_other_and_only_cli_and_benchmarks_import_cli() -> None:
    bad = []
    for m in GRAPH:
        top = m.split(".")[0]
        for i in GRAPH[m]:
            other = i.split(".")[0]
            if top in TIERS and other in TIERS and other != top:
                bad.append(f"{m} -> {i}")
            if other == "cli" and top not in ("cli", "bench"):
                bad.append(f"{m} -> {i}")
            if other == "bench" and top != "bench":
                bad.append(f"{m} -> {i}")
    assert bad == []


def test_the_module_graph_has_no_cycle() -> None:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges(m)):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n) :], n] if n in path else [m, n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_module_and_functions_stay_small(name: str) -> None:
    path = dict(modules())[name]
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_MODULE_LINES, f"{path}: {len(lines)} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse("\n".join(lines)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == [], f"{path}: {long}"
