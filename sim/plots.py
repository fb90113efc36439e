"""The run's PNG plots (matplotlib, imported here only; ``sim.report`` checks it is there).

- ``latency_vs_load.png``: e2e P99 (solid) and P50 (dashed) against offered load,
  one colour per policy, from the scenarios named ``steady…``;
- ``utilisation_cdf.png``: the per-GPU utilisation CDF of each policy at the highest
  steady load;
- ``timeline_<scenario>.png`` for each scenario with events: the windowed e2e P99
  over time per policy with the events marked, and the regions' shares of the
  traffic under Meridian and under the greedy clairvoyant reference.

Figures are drawn on ``matplotlib.figure.Figure`` with the Agg canvas directly, so
nothing touches pyplot's global state or the process's backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.results import PolicyResult, RunResults, ScenarioResult
from sim.tables import BOUND, GREEDY, ordered_policies, slug, steady_scenarios

MERIDIAN = "meridian"
DPI = 100
CMAP = "tab10"


def _figure(width: float, height: float, rows: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True)
    return fig, [row[0] for row in axes]


def _log_seconds(ax: Any) -> None:
    """A log axis of seconds labelled 0.5, 1, 2 rather than 5×10⁻¹."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _colours(names: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps[CMAP]
    fixed = {BOUND: "black", GREEDY: "grey"}
    return {name: fixed.get(name, cmap(i % 10)) for i, name in enumerate(names)}


def write_plots(out_dir: Path, run: RunResults) -> list[Path]:
    """Every plot the run has data for, written into ``out_dir``; their paths."""
    written = []
    steady = steady_scenarios(run)
    if steady:
        written.append(latency_vs_load(out_dir / "latency_vs_load.png", steady))
        written.append(utilisation_cdf(out_dir / "utilisation_cdf.png", steady[-1]))
    for scenario in run.scenarios:
        if scenario.events:
            path = out_dir / f"timeline_{slug(scenario.name)}.png"
            written.append(timeline(path, scenario))
    return written


def latency_vs_load(path: Path, steady: Sequence[ScenarioResult]) -> Path:
    names = ordered_policies({n: r for s in steady for n, r in s.policies.items()})
    colours = _colours(names)
    fig, (ax,) = _figure(8, 5)
    for name in names:
        points = [(s.load * 100, s.policies[name]) for s in steady if name in s.policies]
        for field, style, label in (("e2e_p99_s", "-", name), ("e2e_p50_s", "--", None)):
            # A percentile among the failures (inf) has no point: the table says "∞".
            values = [(x, getattr(r, field)) for x, r in points]
            xy = [(x, v) for x, v in values if v is not None and math.isfinite(v)]
            if xy:
                ax.plot(
                    *zip(*xy, strict=True),
                    style,
                    marker="o",
                    ms=3,
                    color=colours[name],
                    label=label,
                )
    _log_seconds(ax)
    ax.set_xlabel("offered load (% of fleet capacity)")
    ax.set_ylabel("end-to-end latency (s): P99 solid, P50 dashed")
    ax.set_title("Latency against load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.savefig(path)
    return path


def utilisation_cdf(path: Path, scenario: ScenarioResult) -> Path:
    names = ordered_policies(scenario.policies)
    colours = _colours(names)
    fig, (ax,) = _figure(8, 5)
    for name in names:
        cdf = scenario.policies[name].utilisation_cdf
        if not cdf:
            continue
        share = [i / (len(cdf) - 1) if len(cdf) > 1 else 1.0 for i in range(len(cdf))]
        ax.step([u * 100 for u in cdf], share, where="post", color=colours[name], label=name)
    ax.set_xlabel("GPU utilisation (% of the run busy)")
    ax.set_ylabel("share of GPUs at or below")
    ax.set_title(f"Utilisation across GPUs, {scenario.name} ({scenario.load * 100:.0f}% load)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.savefig(path)
    return path


def _share_panel(ax: Any, name: str, result: PolicyResult, colours: dict[str, Any]) -> None:
    tl = result.timeline
    times = [tl.time_s(i) for i in range(len(tl.arrived))]
    for region, shares in tl.region_share.items():
        ax.plot(
            times,
            [float("nan") if v is None else v for v in shares],
            lw=1,
            color=colours[region],
            label=region,
        )
    ax.set_ylim(0, 1)
    ax.set_ylabel(f"region share\n({name})")
    ax.legend(fontsize=7, ncols=3, loc="upper right")
    ax.grid(True, alpha=0.3)


def timeline(path: Path, scenario: ScenarioResult) -> Path:
    names = ordered_policies(scenario.policies)
    colours = _colours(names)
    panels = [n for n in (MERIDIAN, GREEDY) if n in scenario.policies]
    fig, axes = _figure(10, 4 + 2 * len(panels), rows=1 + len(panels))
    top = axes[0]
    for name in names:
        tl = scenario.policies[name].timeline
        xy = [(tl.time_s(i), v) for i, v in enumerate(tl.p99_e2e_s) if v is not None]
        if xy:
            top.plot(*zip(*xy, strict=True), lw=1.2, color=colours[name], label=name)
    _log_seconds(top)
    top.set_ylabel(
        f"e2e P99 (s), {scenario.policies[names[0]].timeline.window_buckets}-bucket window"
    )
    top.set_title(f"{scenario.name}: {scenario.description}")
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=7, ncols=3)
    regions = sorted({r for n in panels for r in scenario.policies[n].timeline.region_share})
    region_colours = _colours(regions)
    for ax, name in zip(axes[1:], panels, strict=True):
        _share_panel(ax, name, scenario.policies[name], region_colours)
    for ax in axes:
        for at, _ in scenario.events:
            ax.axvline(at, color="red", ls=":", lw=1)
    for at, label in scenario.events:
        top.annotate(
            label,
            (at, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="red",
            bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1},
        )
    axes[-1].set_xlabel("simulated time (s)")
    fig.savefig(path)
    return path
