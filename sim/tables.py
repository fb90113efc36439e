"""``fleet.md``: a run's results as GitHub Markdown tables.

One table per scenario (a row per policy, then the references: the lower
``bound`` and the ``greedy_clairvoyant`` placement) and a headline table across
the steady-load scenarios. Every policy's TTFT and e2e P99 are also shown as ×
the bound. In every column with a clear direction the best value among the
policies (never a reference) is in bold (ties all bold); the cross-region share
has no better direction, so it is never bold. A percentile that falls among the
failed requests (infinitely late) prints as "∞".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from sim.regional_load import load_table
from sim.results import PolicyResult, RunResults, ScenarioResult

BOUND = "bound"
GREEDY = "greedy_clairvoyant"
# Rows that are not routers: shown last, never bold, named for what they are.
REFERENCES = {BOUND: "lower bound", GREEDY: "clairvoyant reference, not a bound"}
STEADY = "steady"


def seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    if math.isinf(value):
        return "∞"
    if value < 1.0:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def percent(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{value * 100:.1f}%"


def points(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{value * 100:.1f} pt"


def millis(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.1f} ms"


def ratio(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    return "∞" if math.isinf(value) else f"{value:.2f}×"


def recovery_text(result: PolicyResult) -> str:
    parts = [
        "never" if r.recovery_s is None else f"{r.recovery_s:.0f} s" for r in result.recoveries
    ]
    return " / ".join(parts) or "–"


def recovery_key(result: PolicyResult) -> float | None:
    """The slowest recovery (never = infinite); None when the scenario had no event."""
    if not result.recoveries:
        return None
    return max(math.inf if r.recovery_s is None else r.recovery_s for r in result.recoveries)


@dataclass(frozen=True)
class Column:
    """A table column: its header, its value (given the result and the bound's), how
    the value prints (or, with ``show``, how the result does), which way is better."""

    header: str
    value: Callable[[PolicyResult, PolicyResult | None], float | None]
    text: Callable[[float | None], str]
    better: str | None  # "low", "high" or None
    show: Callable[[PolicyResult], str] | None = None


def _vs_bound(name: str) -> Callable[[PolicyResult, PolicyResult | None], float | None]:
    return lambda r, bound: r.ratio_to(bound)[name] if bound else None


def failed_share(r: PolicyResult, _: PolicyResult | None) -> float | None:
    return r.failed_total / r.offered if r.offered else None


def _recovery_value(r: PolicyResult, _: PolicyResult | None) -> float | None:
    return recovery_key(r)


def _field(name: str) -> Callable[[PolicyResult, PolicyResult | None], float | None]:
    return lambda r, _: getattr(r, name)


COLUMNS: tuple[Column, ...] = (
    Column("TTFT P50", _field("ttft_p50_s"), seconds, "low"),
    Column("TTFT P99", _field("ttft_p99_s"), seconds, "low"),
    Column("TTFT P99 ×bound", _vs_bound("ttft_p99_s"), ratio, "low"),
    Column("e2e P50", _field("e2e_p50_s"), seconds, "low"),
    Column("e2e P90", _field("e2e_p90_s"), seconds, "low"),
    Column("e2e P99", _field("e2e_p99_s"), seconds, "low"),
    Column("e2e P99 ×bound", _vs_bound("e2e_p99_s"), ratio, "low"),
    Column("failed", failed_share, percent, "low"),
    Column("goodput", _field("goodput"), percent, "high"),
    Column("util mean", _field("util_mean"), percent, "high"),
    Column("util loaded", _field("util_loaded_mean"), percent, "high"),
    Column("util σ", _field("util_std"), points, "low"),
    Column("prefix hits", _field("prefix_hit_rate"), percent, "high"),
    Column("cross-region", _field("cross_region_share"), percent, None),
    Column("added RTT", _field("added_rtt_ms"), millis, "low"),
    Column("recovery", _recovery_value, seconds, "low", show=recovery_text),
)


def bold_best(
    values: Sequence[float | None], better: str | None, skip: Collection[int] = ()
) -> list[bool]:
    """Which entries to bold: those equal to the best known value, ignoring the entries
    in ``skip`` (the references)."""
    known = [
        v for i, v in enumerate(values) if i not in skip and v is not None and not math.isnan(v)
    ]
    if better is None or not known:
        return [False] * len(values)
    best = min(known) if better == "low" else max(known)
    if math.isinf(best):
        return [False] * len(values)
    return [
        i not in skip and v is not None and math.isclose(v, best, rel_tol=1e-9, abs_tol=1e-12)
        for i, v in enumerate(values)
    ]


def cell(text: str, bold: bool) -> str:
    return f"**{text}**" if bold and text != "–" else text


def escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub table, the first column left-aligned and the figures right-aligned."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join([":---", *["---:"] * (len(headers) - 1)]) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ordered_policies(policies: Mapping[str, object]) -> list[str]:
    """The policies as given, then the references (the bound last)."""
    routers = [n for n in policies if n not in REFERENCES]
    return routers + [n for n in (GREEDY, BOUND) if n in policies]


def references(names: Sequence[str]) -> set[int]:
    """Indices of ``names`` that are references, not routers."""
    return {i for i, n in enumerate(names) if n in REFERENCES}


def policy_name(name: str) -> str:
    what = REFERENCES.get(name)
    return f"*{escape(name)}* ({what})" if what else f"`{escape(name)}`"


def scenario_table(scenario: ScenarioResult) -> str:
    names = ordered_policies(scenario.policies)
    bound = scenario.policies.get(BOUND)
    skip = references(names)
    results = [scenario.policies[n] for n in names]
    columns: list[list[str]] = []
    for col in COLUMNS:
        values = [col.value(r, bound) for r in results]
        bold = bold_best(values, col.better, skip)
        show = col.show
        texts = [show(r) for r in results] if show else [col.text(v) for v in values]
        columns.append([cell(t, b) for t, b in zip(texts, bold, strict=True)])
    rows = [[policy_name(n), *(c[i] for c in columns)] for i, n in enumerate(names)]
    return markdown_table(["policy", *(c.header for c in COLUMNS)], rows)


def steady_scenarios(run: RunResults) -> list[ScenarioResult]:
    return sorted((s for s in run.scenarios if s.name.startswith(STEADY)), key=lambda s: s.load)


def headline_table(run: RunResults) -> str | None:
    """Per policy at each steady load: TTFT and e2e P99 (each also × the bound) and
    goodput."""
    steady = steady_scenarios(run)
    if not steady:
        return None
    names = ordered_policies({n: r for s in steady for n, r in s.policies.items()})
    skip = references(names)
    columns: list[list[str]] = []
    headers: list[str] = []
    for s in steady:
        bound = s.policies.get(BOUND)
        results = [s.policies.get(n) for n in names]
        for figure in ("ttft_p99_s", "e2e_p99_s"):
            values = [getattr(r, figure) if r else None for r in results]
            vs = [r.ratio_to(bound)[figure] if r and bound else None for r in results]
            texts = [
                seconds(v) + (f" ({ratio(x)})" if x is not None else "")
                for v, x in zip(values, vs, strict=True)
            ]
            bold = bold_best(values, "low", skip)
            columns.append([cell(t, b) for t, b in zip(texts, bold, strict=True)])
        good = [r.goodput if r else None for r in results]
        columns.append(
            [cell(percent(g), b) for g, b in zip(good, bold_best(good, "high", skip), strict=True)]
        )
        load = f"{s.load * 100:.0f}%"
        headers += [f"TTFT P99 @ {load}", f"e2e P99 @ {load}", f"goodput @ {load}"]
    rows = [[policy_name(n), *(c[i] for c in columns)] for i, n in enumerate(names)]
    return markdown_table(["policy", *headers], rows)


def tenant_table(scenario: ScenarioResult) -> str | None:
    """Per policy and tenant: e2e P99 and goodput (only when there are several tenants)."""
    tenants = sorted({t for r in scenario.policies.values() for t in r.tenants})
    if len(tenants) < 2:
        return None
    names = ordered_policies(scenario.policies)
    rows = []
    for n in names:
        stats = scenario.policies[n].tenants
        rows.append(
            [
                policy_name(n),
                *(
                    f"{seconds(stats[t].e2e_p99_s)} · {percent(stats[t].goodput)}"
                    if t in stats
                    else "–"
                    for t in tenants
                ),
            ]
        )
    return markdown_table(["policy", *(f"`{escape(t)}` P99 · goodput" for t in tenants)], rows)


def herding_table(scenario: ScenarioResult) -> str | None:
    """Per policy, how the crowded region's share moved (less is better: it settled)."""
    names = [n for n in ordered_policies(scenario.policies) if scenario.policies[n].herding]
    if not names:
        return None
    herds = [scenario.policies[n].herding for n in names]
    skip = references(names)
    std = [h.share_std if h else None for h in herds]
    swing = [h.max_swing if h else None for h in herds]
    rows = [
        [
            policy_name(n),
            f"`{escape(h.region)}`" if h else "–",
            percent(h.share_mean if h else None),
            cell(points(s), bold_s),
            cell(points(w), bold_w),
        ]
        for n, h, s, w, bold_s, bold_w in zip(
            names,
            herds,
            std,
            swing,
            bold_best(std, "low", skip),
            bold_best(swing, "low", skip),
            strict=True,
        )
    ]
    headers = ["policy", "crowded region", "its share", "share σ", "largest swing"]
    return markdown_table(headers, rows)


def slug(name: str) -> str:
    """A scenario name as a file-name part."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "scenario"


def render_markdown(run: RunResults, images: Sequence[str], *, note: str = "") -> str:
    parts = ["# Fleet simulation results", ""]
    parts += [
        f"- **{escape(k)}**: {v if isinstance(v, str) else json.dumps(v)}"
        for k, v in run.meta.items()
    ]
    parts += ["", LEGEND, ""]
    if note:
        parts += [f"> {note}", ""]
    headline = headline_table(run)
    if headline:
        parts += ["## Headline: steady load", "", headline, ""]
    parts += [f"![{name[:-4]}]({name})" for name in images if not name.startswith("timeline_")]
    for s in run.scenarios:
        parts += ["", f"## {escape(s.name)}", "", escape(s.description), ""]
        parts += [f"Offered load: {s.load * 100:.0f}% of fleet capacity."]
        if s.events:
            parts += ["", "Events:", *(f"- {at:.0f} s: {escape(label)}" for at, label in s.events)]
        parts += ["", scenario_table(s)]
        if s.regional_load is not None:
            parts += ["", "**Offered load ÷ capacity by region**", "", load_table(s.regional_load)]
        for title, table in (("Tenants", tenant_table(s)), ("Flash crowd", herding_table(s))):
            if table:
                parts += ["", f"**{title}**", "", table]
        image = f"timeline_{slug(s.name)}.png"
        if image in images:
            parts += ["", f"![timeline of {escape(s.name)}]({image})"]
    speed = speed_table(run)
    if speed:
        parts += ["", "## Simulation speed", "", SPEED_LEGEND, "", speed]
    return "\n".join(parts).rstrip() + "\n"


SPEED_LEGEND = (
    "Wall time of the process that simulated each run (runs share the machine's cores with "
    "each other when `jobs` > 1, and with whatever else ran)."
)


def speed_table(run: RunResults) -> str | None:
    """Per run: arrivals simulated, wall seconds, and arrivals per second."""
    rows = [
        [
            escape(s.name),
            f"`{name}`",
            f"{r.sim_requests:,}",
            f"{r.sim_wall_s:,.1f} s",
            f"{r.sim_requests / r.sim_wall_s:,.0f}" if r.sim_wall_s > 0 else "–",
        ]
        for s in run.scenarios
        for name, r in s.policies.items()
        if r.sim_wall_s is not None and r.sim_requests is not None
    ]
    if not rows:
        return None
    return markdown_table(["scenario", "policy", "requests", "wall", "requests/s"], rows)


LEGEND = (
    "Latencies are client-perceived (RTT included) over every *offered* request, a failed or "
    "shed one counting as infinitely late (∞: the percentile falls among the failures; "
    "*failed* is their share); ×bound divides by the lower bound's figure (`bound`: each "
    "request alone on the fastest GPU serving its model, nearest region, only its shared "
    "prefix cached; every policy is at or above it request by request). `greedy_clairvoyant` "
    "places each request greedily knowing every true length and speed: a reference, not a "
    "bound. Goodput is the share of offered requests within both SLOs; utilisation is busy "
    "time over the run, σ its spread across GPUs in percentage points; added RTT is what "
    "requests served away from their home region paid over it; recovery is the time after each "
    "event until the windowed P99 of the served requests was back within 1.2× of its value "
    "before. **Bold**: the best value among the routers (never a reference)."
)
