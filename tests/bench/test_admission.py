"""bench/admission's harness: each variant runs on its own checkout and its figures add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_measures_this_checkout_against_a_compared_one(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "bench.admission", "--rounds", "1", "--seconds", "0.3",
            "--compare", str(ROOT), "--name", "t", "--no-write"]  # fmt: skip
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| this checkout", "| compared 1"]
    for row in rows:
        per_s, edge_us, redis_us = (float(x) for x in row.strip(" |").split(" | ")[-3:])
        assert per_s > 0 and edge_us > 0 and redis_us > 0
    assert "- this checkout: edge CPU" in out.stdout


def test_a_child_prints_its_figures_as_json() -> None:
    argv = [sys.executable, str(ROOT / "bench" / "admission.py"), "--child", "--seconds", "0.2"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(figures) == {"per_s", "edge_us", "redis_us"}
    assert figures["per_s"] > 100  # 32 callers admit far more than this in a second
