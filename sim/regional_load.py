"""Each region's offered load over a run as a share of its capacity: computed, not simulated.

The workload's ``Mixer`` gives every city's rate at every time, piecewise constant
between diurnal steps and boost edges (``sim.arrivals``). A city's requests count
against its nearest region, the one of least estimated RTT (first on a tie), as the
simulator's home region does (``sim.run.Geography``); a region's capacity is
``sim.capacity.fleet_capacity_rps`` over its GPUs for the workload's mean request
(the basis ``sim.run.arrival_rate`` turns a load into a rate on).
Above 1 a region cannot serve its own clients whatever the routing does: the rest
must spill to other regions or queue.

Fleet-wide the ratio is the scenario's load at every instant outside boosts, not
only on average: the Mixer normalises the cities' diurnal weights at every step,
so the curve moves traffic between cities and never changes the total. A
compressed day therefore keeps the fleet at its load while each region's share
rises and falls with its clients' local time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from common.basics.geo import GeoPoint, rtt_estimate_ms
from sim.arrivals import DIURNAL_STEPS_PER_DAY, Mixer
from sim.capacity import fleet_capacity_rps
from sim.geography import City
from sim.stats import infinite_as_text

if TYPE_CHECKING:
    from common.config.topology import Topology
    from sim.workload import WorkloadSpec

# Points of a run's series: one per hour of a compressed day.
SERIES_POINTS = 24
# Columns of the report's table: the series averaged over eighths of the run.
TABLE_COLUMNS = 8
DAY_S = 86_400.0


@dataclass
class RegionalLoad:
    """Per region, offered rate ÷ capacity over a run of ``duration_s``.

    ``series[r][i]`` is the time-weighted mean over the i-th of ``len(series[r])``
    equal slices of the run; ``peak[r]`` the highest value over the Mixer's
    constant segments and ``peak_at_s[r]`` the start of the first segment reaching
    it; ``fleet_mean`` the whole fleet's offered ÷ capacity averaged over the run."""

    duration_s: float
    gpus: dict[str, int]
    capacity_rps: dict[str, float]
    series: dict[str, list[float]]
    peak: dict[str, float]
    peak_at_s: dict[str, float]
    fleet_mean: float

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; a region with no capacity reads "inf" (JSON has no
        infinity, and ``float`` reads the text back in ``from_json``)."""
        out: dict[str, Any] = infinite_as_text(asdict(self))
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RegionalLoad:
        return cls(
            duration_s=float(data["duration_s"]),
            gpus={k: int(v) for k, v in data["gpus"].items()},
            capacity_rps={k: float(v) for k, v in data["capacity_rps"].items()},
            series={k: [float(x) for x in v] for k, v in data["series"].items()},
            peak={k: float(v) for k, v in data["peak"].items()},
            peak_at_s={k: float(v) for k, v in data["peak_at_s"].items()},
            fleet_mean=float(data["fleet_mean"]),
        )


def nearest_region(origin: GeoPoint, locations: Mapping[str, GeoPoint]) -> str:
    """The region of least estimated RTT from ``origin`` (the first listed on a tie)."""
    return min(locations, key=lambda r: rtt_estimate_ms(origin, locations[r]))


def day_peak_shares(cities: Sequence[City], locations: Mapping[str, GeoPoint]) -> dict[str, float]:
    """Per region, the highest share of the fleet's traffic its clients (the cities
    nearest it) send at any diurnal step of a day; 0 for a region nearest no city.
    The shares sum to at least 1: regions peak at different hours."""
    mixer = Mixer(cities, [("all", 1.0)], diurnal=True, start_utc_hour=0.0, day_length_s=DAY_S)
    homes = [nearest_region(c.location, locations) for c in cities]
    peaks = dict.fromkeys(locations, 0.0)
    for step in range(DIURNAL_STEPS_PER_DAY):
        shares = dict.fromkeys(locations, 0.0)
        for home, share in zip(homes, mixer.city_shares(step * mixer.step_s), strict=True):
            shares[home] += share
        for region, share in shares.items():
            peaks[region] = max(peaks[region], share)
    return peaks


def _segments(mixer: Mixer, duration_s: float) -> Iterator[tuple[float, float, list[float]]]:
    """(start, end, each city's share of the rate, boosts included) over [0, duration_s)."""
    tenants = len(mixer.tenant_ids)
    t = 0.0
    while t < duration_s:
        mixer.set_time(t)
        end = min(mixer.until, duration_s)
        joint = [b - a for a, b in zip([0.0, *mixer.cum[:-1]], mixer.cum, strict=True)]
        yield t, end, [sum(joint[i : i + tenants]) for i in range(0, len(joint), tenants)]
        t = end


def regional_load(
    workload: WorkloadSpec,
    topology: Topology,
    duration_s: float,
    points: int = SERIES_POINTS,
) -> RegionalLoad:
    """Each region's offered ÷ capacity over ``[0, duration_s)`` of ``workload`` (at its
    ``rate_rps``, diurnal curve and boosts) on ``topology``'s GPUs."""
    if not (duration_s > 0 and math.isfinite(duration_s)) or points < 1:
        raise ValueError(f"needs duration_s > 0 and points >= 1, got {duration_s}, {points}")
    prompt, output = workload.mean_tokens()
    regions = [r.name for r in topology.regions]
    own = {r.name: [g for z in r.zones for g in z.gpus] for r in topology.regions}
    capacity = {name: fleet_capacity_rps(own[name], prompt, output) for name in regions}
    locations = {r.name: r.location for r in topology.regions}
    homes = [nearest_region(c.location, locations) for c in workload.cities]
    mixer = workload.mixer()
    slice_s = duration_s / points
    series = {name: [0.0] * points for name in regions}
    peak = dict.fromkeys(regions, -math.inf)
    peak_at = dict.fromkeys(regions, 0.0)
    offered_total = 0.0
    for start, end, shares in _segments(mixer, duration_s):
        offered = dict.fromkeys(regions, 0.0)
        for home, share in zip(homes, shares, strict=True):
            offered[home] += workload.rate_rps * share
        offered_total += sum(offered.values()) * (end - start)
        for name in regions:
            ratio = _share(offered[name], capacity[name])
            if ratio > peak[name]:
                peak[name], peak_at[name] = ratio, start
            _spread(series[name], ratio, start, end, slice_s)
    fleet_capacity = sum(capacity.values())
    return RegionalLoad(
        duration_s=duration_s,
        gpus={name: len(own[name]) for name in regions},
        capacity_rps=capacity,
        series={name: [v / slice_s for v in values] for name, values in series.items()},
        peak=peak,
        peak_at_s=peak_at,
        fleet_mean=offered_total / duration_s / fleet_capacity if fleet_capacity else math.inf,
    )


def _share(offered: float, capacity: float) -> float:
    """Offered ÷ capacity; a region with no capacity reads inf when offered anything."""
    if capacity > 0:
        return offered / capacity
    return math.inf if offered > 0 else 0.0


def _spread(slices: list[float], value: float, start: float, end: float, slice_s: float) -> None:
    """Add ``value`` × the overlap of [start, end) with each slice (of ``slice_s``)."""
    first = min(int(start / slice_s), len(slices) - 1)
    for i in range(first, min(math.ceil(end / slice_s), len(slices))):
        overlap = min(end, (i + 1) * slice_s) - max(start, i * slice_s)
        if overlap > 0:
            slices[i] += value * overlap


def load_table(load: RegionalLoad, columns: int = TABLE_COLUMNS) -> str:
    """A Markdown table: a row per region with its GPUs, capacity, mean and peak offered
    ÷ capacity (bold above 1: more than the region can serve) and the series averaged
    over ``columns`` equal parts of the run, headed by each part's start."""
    points = len(next(iter(load.series.values()), []))
    columns = max(1, min(columns, points))
    bounds = [round(k * points / columns) for k in range(columns + 1)]
    part_s = [load.duration_s * bounds[k] / points for k in range(columns)]
    header = ["region", "GPUs", "capacity", "mean", "peak", "peak at"]
    header += [_seconds(t, load.duration_s) for t in part_s]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, values in load.series.items():
        parts = [
            sum(values[bounds[k] : bounds[k + 1]]) / (bounds[k + 1] - bounds[k])
            for k in range(columns)
        ]
        mean = sum(values) / len(values) if values else math.nan
        row = [
            name,
            str(load.gpus[name]),
            f"{load.capacity_rps[name]:.0f} rps",
            _ratio(mean),
            _ratio(load.peak[name]),
            _seconds(load.peak_at_s[name], load.duration_s),
            *(_ratio(p) for p in parts),
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(
        f"| fleet | {sum(load.gpus.values())} | {sum(load.capacity_rps.values()):.0f} rps "
        f"| {_ratio(load.fleet_mean)} |" + " |" * (len(header) - 4)
    )
    return "\n".join(lines)


def _seconds(t: float, duration_s: float) -> str:
    """A time of the run, to a tenth of a second in a run shorter than 100 s."""
    return f"{t:.1f} s" if duration_s < 100 else f"{t:.0f} s"


def _ratio(value: float) -> str:
    text = f"{value:.2f}"
    return f"**{text}**" if value > 1 else text
