"""What every benchmark records beside its figures: the machine, the commit, percentiles."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine() -> dict[str, str | int | None]:
    """The machine a benchmark ran on (figures from different machines do not compare)."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def revision() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(
                ["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "-uno", "--porcelain")),
    }


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def write_json_and_markdown(directory: Path, name: str, result: Any, text: str) -> None:
    """``name.json`` (the figures) and ``name.md`` (the table printed) in ``directory``."""
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (directory / f"{name}.md").write_text(text)


def git_head(path: Path) -> str:
    """``<short hash> <subject>`` of the checkout at ``path`` (a compared tree's code)."""
    out = subprocess.run(
        ["git", "-C", str(path), "log", "-1", "--format=%h %s"], capture_output=True, text=True
    )
    return out.stdout.strip() or "(not a git checkout)"
