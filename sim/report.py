"""A simulation run's results and the files that report them.

``write_results`` writes ``fleet.json`` (every figure, readable back with
``RunResults.from_json``), ``fleet.md`` (``sim.tables``: a table per scenario and
a headline across the steady loads) and, when matplotlib is installed (the
``sim`` extra), the PNG plots of ``sim.plots``. Without matplotlib it says so
once and writes the rest.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from sim.results import PolicyResult, RunResults, ScenarioResult
from sim.tables import render_markdown

__all__ = ["PolicyResult", "RunResults", "ScenarioResult", "write_results"]

log = logging.getLogger(__name__)

JSON_NAME = "fleet.json"
MARKDOWN_NAME = "fleet.md"
NO_MATPLOTLIB = (
    "matplotlib is not installed (pip install 'meridian-lb[sim]'): "
    "writing fleet.json and fleet.md without plots"
)


def write_results(out_dir: Path, run: RunResults, *, plots: bool = True) -> list[Path]:
    """Write the run's JSON, Markdown and (``plots`` and matplotlib permitting) PNGs
    into ``out_dir``; the paths written, in that order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images: list[Path] = []
    note = ""
    if not plots:
        log.info("plots skipped (plots=False): writing fleet.json and fleet.md only")
    elif importlib.util.find_spec("matplotlib") is None:
        log.warning(NO_MATPLOTLIB)
        note = "Plots were not drawn: matplotlib is not installed (the `sim` extra)."
    else:
        from sim.plots import write_plots

        images = write_plots(out_dir, run)
    json_path = out_dir / JSON_NAME
    json_path.write_text(json.dumps(run.to_json(), allow_nan=False, separators=(",", ":")))
    md_path = out_dir / MARKDOWN_NAME
    md_path.write_text(render_markdown(run, [p.name for p in images], note=note))
    return [json_path, md_path, *images]
