"""What each policy did in each simulated scenario, as figures (``sim.measure`` fills
a ``PolicyResult``; ``sim.report`` writes a ``RunResults``).

Every figure that cannot be known (a percentile of no request, a hit rate over no
prompt token, a recovery that never came) is None, never zero. ``to_json`` gives
plain JSON types and ``from_json`` rebuilds an equal object, so a run's
``fleet.json`` can be read back and re-reported without re-simulating.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from sim.regional_load import RegionalLoad
from sim.stats import infinite_as_text, infinite_from_text

# The figures ``ratio_to`` compares with a reference's (the bound's), in the order reports use.
HEADLINE: tuple[str, ...] = (
    "ttft_p50_s",
    "ttft_p99_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "e2e_p99_s",
    "goodput_ttft",
    "goodput_e2e",
    "goodput",
    "util_mean",
    "util_loaded_mean",
    "util_std",
    "prefix_hit_rate",
    "cross_region_share",
    "added_rtt_ms",
)


@dataclass
class TenantStats:
    """One tenant's requests: how many were served and failed, their e2e P99 and goodput."""

    served: int
    failed: int
    e2e_p99_s: float | None
    goodput: float | None


@dataclass
class Timeline:
    """The run bucket by bucket (bucket i starts at ``start_s + i * bucket_s``).

    Requests are placed by arrival, except ``finished`` (by the time the last token
    reached the client). ``p99_e2e_s[i]`` is the e2e P99 of the requests served
    among those arriving in the ``window_buckets`` buckets ending at i (a trailing
    window: one bucket of a second holds too few requests for a stable P99);
    ``region_share[r][i]`` is the share of bucket i's served arrivals served in
    region r. Empty buckets read None. Values are rounded (P99 to 0.1 ms, shares
    to 1e-4) to keep ``fleet.json`` small.
    """

    start_s: float
    bucket_s: float
    window_buckets: int
    arrived: list[int]
    finished: list[int]
    failed: list[int]
    p99_e2e_s: list[float | None]
    region_share: dict[str, list[float | None]]

    def time_s(self, i: int) -> float:
        return self.start_s + i * self.bucket_s


@dataclass
class Recovery:
    """After a failure event: the windowed P99 before it (the median over the 60 s
    before), its peak after, and how long until a whole window of arrivals was back
    within 1.2× of it (None: not within the run)."""

    at_s: float
    label: str
    baseline_p99_s: float | None
    peak_p99_s: float | None
    recovery_s: float | None


@dataclass
class Herding:
    """During a flash crowd, how the crowded region's share of the served traffic moved
    from bucket to bucket: a router that herds swings it between regions on every
    summary; one that spills in proportion lets it settle."""

    region: str
    start_s: float
    end_s: float
    share_mean: float
    share_std: float
    max_swing: float


@dataclass
class PolicyResult:
    """Every figure of one policy in one scenario (see ``sim.measure.Recorder.finish``)."""

    offered: int
    served: int
    failed: dict[str, int]
    retried: int
    slo_ttft_s: float
    slo_e2e_s: float
    warmup_s: float
    duration_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    goodput_ttft: float | None
    goodput_e2e: float | None
    goodput: float | None
    gpus: int
    util_mean: float | None
    util_p10: float | None
    util_p90: float | None
    util_std: float | None
    slot_occupancy_mean: float | None
    utilisation_cdf: list[float]
    prefix_hit_rate: float | None
    cross_region_share: float | None
    added_rtt_ms: float | None
    served_by_region: dict[str, int]
    tenants: dict[str, TenantStats]
    timeline: Timeline
    recoveries: list[Recovery]
    herding: Herding | None
    # Busy share from the warm-up's end to the last arrival (``sim.busy_window``);
    # None in results written before it was measured.
    util_loaded_mean: float | None = None
    util_loaded_p10: float | None = None
    # What simulating it took: wall seconds of the process that ran it, and the arrivals
    # it was fed (None in results written before they were recorded).
    sim_wall_s: float | None = None
    sim_requests: int | None = None

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    def ratio_to(self, reference: PolicyResult) -> dict[str, float]:
        """Each ``HEADLINE`` figure divided by ``reference``'s (NaN where either is
        unknown or the reference's is zero): below 1 is better for latencies, above 1
        for goodput."""
        out: dict[str, float] = {}
        for name in HEADLINE:
            mine, theirs = getattr(self, name), getattr(reference, name)
            ok = mine is not None and theirs is not None and theirs != 0
            out[name] = mine / theirs if ok else math.nan
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = infinite_as_text(asdict(self))
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicyResult:
        data = infinite_from_text(data)
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        unknown = sorted(set(data) - known)
        missing = sorted(required - set(data))
        if unknown or missing:
            raise ValueError(f"PolicyResult JSON: unknown keys {unknown}, missing keys {missing}")
        values = dict(data)
        values["failed"] = dict(data["failed"])
        values["served_by_region"] = dict(data["served_by_region"])
        values["utilisation_cdf"] = list(data["utilisation_cdf"])
        values["tenants"] = {k: TenantStats(**v) for k, v in data["tenants"].items()}
        timeline = dict(data["timeline"])
        timeline["region_share"] = {k: list(v) for k, v in timeline["region_share"].items()}
        values["timeline"] = Timeline(**timeline)
        values["recoveries"] = [Recovery(**r) for r in data["recoveries"]]
        values["herding"] = Herding(**data["herding"]) if data["herding"] else None
        return cls(**values)


@dataclass
class ScenarioResult:
    """One scenario (``load`` as a fraction of fleet capacity, its timed events), every
    policy's result on the same arrivals."""

    name: str
    description: str
    load: float
    events: list[tuple[float, str]]
    policies: dict[str, PolicyResult]
    # Each region's offered load ÷ capacity over the run (``sim.regional_load``); None
    # for a trace replay and in results written before it was computed.
    regional_load: RegionalLoad | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "load": self.load,
            "events": [[at, label] for at, label in self.events],
            "policies": {name: r.to_json() for name, r in self.policies.items()},
            "regional_load": self.regional_load.to_json() if self.regional_load else None,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScenarioResult:
        return cls(
            name=data["name"],
            description=data["description"],
            load=data["load"],
            events=[(float(at), str(label)) for at, label in data["events"]],
            policies={k: PolicyResult.from_json(v) for k, v in data["policies"].items()},
            regional_load=(
                RegionalLoad.from_json(data["regional_load"]) if data.get("regional_load") else None
            ),
        )


@dataclass
class RunResults:
    """A whole ``meridian sim run``: what was run (``meta``: seed, fleet, workload, …)
    and each scenario's results."""

    meta: dict[str, Any]
    scenarios: list[ScenarioResult]

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "scenarios": [s.to_json() for s in self.scenarios]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunResults:
        return cls(
            meta=dict(data["meta"]),
            scenarios=[ScenarioResult.from_json(s) for s in data["scenarios"]],
        )
