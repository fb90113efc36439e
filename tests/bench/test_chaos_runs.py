"""The chaos bench runs: one fault of it, end to end, as ``python -m bench.chaos`` runs it
(``meridian up`` from this checkout, the load, SIGKILL of a GPU worker and its restart,
the usage check), on a cut-down demo fleet with short phases, so it cannot rot unseen.

The fleet keeps what the bench relies on: the victim zone ``eu-west-1a`` with a V2 GPU
and the demo's OpenAI-protocol GPU (readiness after the restart is asked of each in its
own protocol), a second zone in the region to fail over to, tenants ``demo`` and
``free-tier``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from bench.chaos_faults import VICTIM_REGION, VICTIM_ZONE
from cli.launcher import DEMO_FLEET

ROOT = Path(__file__).resolve().parents[2]


def small_chaos_fleet() -> dict[str, Any]:
    """The demo fleet cut to the victim region: its two zones, two GPUs in the victim
    zone (one of them the OpenAI GPU), one in the other."""
    spec: dict[str, Any] = yaml.safe_load(DEMO_FLEET.read_text())
    region = next(r for r in spec["regions"] if r["name"] == VICTIM_REGION)
    victim = next(z for z in region["zones"] if z["name"] == VICTIM_ZONE)
    openai_gpus = [g for g in victim["gpus"] if g.get("protocol") == "openai"]
    assert len(openai_gpus) == 1, "the demo's victim zone has one OpenAI-protocol GPU"
    victim["gpus"] = [victim["gpus"][0], *openai_gpus]
    other = next(z for z in region["zones"] if z["name"] != VICTIM_ZONE)
    other["gpus"] = other["gpus"][:1]
    region["zones"] = [victim, other]
    spec["regions"] = [region]
    for tenant in spec["auth"]["tenants"]:
        tenant.pop("allowed_regions", None)  # the other regions are gone
    return spec


def test_one_fault_of_the_chaos_bench_runs_end_to_end(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(small_chaos_fleet(), sort_keys=False))
    out = tmp_path / "chaos.json"
    argv = [
        *(sys.executable, "-m", "bench.chaos", "--faults", "sigkill-worker"),
        *("--fleet", str(fleet_file), "--out", str(out)),
        *("--timing", "1,1,1,1", "--concurrency", "4", "--max-shots", "5000"),
        *("--budget-s", "45"),
    ]
    # The bench stops every process it started, on error and past its budget too.
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(out.read_text())
    [phase] = result["phases"]
    assert (phase["fault"], phase["target"]) == ("sigkill-worker", f"worker-{VICTIM_ZONE}")
    assert phase["note"] == "started again by the bench"
    assert phase["times_s"]["serving_again"] > phase["times_s"]["restore"]
    assert phase["failures"]["calls"] > 0
    usage = phase["usage"]
    assert usage["error"] == ""
    assert (usage["lost"], usage["doubled"], usage["phantom"], usage["erased"]) == (0, 0, 0, 0)
    run = result["run_usage"]
    assert run["served"] == run["billed"] > 0
