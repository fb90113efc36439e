"""Scenarios: a load level, workload boosts, and failures at given times.

A scenario is data: the load (a fraction of the fleet's capacity), the boosts
it adds to the workload (a flash crowd, a flooding tenant) and the events it
applies to the fleet (a zone or region lost, GPUs throttled). ``apply`` acts
on the simulated GPUs — which every policy has, the greedy reference included — and, for
the tiered policies, on the deployment's tiers (a lost zone's local tier is
down too). Times are fractions of the scenario's duration so one scenario
reads the same at ``--quick`` and at full length; a boost's window is in
seconds where the issue fixes it (the flash crowd lasts 60 s).

Most scenarios hold the clock at one hour of a real day (a run is minutes of it),
so the regions' shares of the traffic stay where that hour puts them. A
``compressed_day`` scenario runs the diurnal curve through the whole run instead
(``sim.run.scenario_workload``): from 00:00 UTC, one day per run, so every
region's evening peak passes while the fleet-wide load stays at ``load``
(``sim.regional_load`` says why and reports each region's curve).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from common.config.topology import RegionConfig, Topology
from sim.deployment import SimDeployment
from sim.gpu_model import SimGpu

# Throttling that appears mid-run: a GPU drops to this share of its speed.
THROTTLED_SPEED = 0.6


@dataclass(frozen=True)
class FleetEvent:
    """Something that happens to the fleet at ``at`` (fraction of the duration)."""

    at: float
    kind: str  # "lose_zone", "lose_region", "throttle"
    fraction: float = 0.1  # of GPUs, for "throttle"

    def label(self, topology: Topology) -> str:
        if self.kind == "throttle":
            return f"{self.fraction:.0%} of GPUs throttled to {THROTTLED_SPEED:.0%} speed"
        region = target_region(topology)
        if self.kind == "lose_zone":
            return f"zone {region.zones[0].name} lost"
        return f"region {region.name} lost"


@dataclass(frozen=True)
class CrowdSpec:
    """The clients nearest the largest region send ``factor``× from ``at`` for ``seconds``."""

    at: float
    seconds: float
    factor: float


@dataclass(frozen=True)
class FloodSpec:
    """One tenant sends ``factor``× its share from ``at`` for ``seconds``."""

    at: float
    seconds: float
    factor: float


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    load: float
    events: tuple[FleetEvent, ...] = ()
    crowd: CrowdSpec | None = None
    flood: FloodSpec | None = None
    # The run is one whole day of the diurnal curve (module docstring).
    compressed_day: bool = False


def _steady(load: float) -> Scenario:
    return Scenario(
        f"steady-{round(load * 100)}", f"steady load at {load:.0%} of fleet capacity", load
    )


def _day(load: float) -> Scenario:
    return Scenario(
        f"day-{round(load * 100)}",
        f"a whole day compressed into the run at {load:.0%} of fleet capacity: "
        "each region's clients peak in turn",
        load,
        compressed_day=True,
    )


SCENARIOS: tuple[Scenario, ...] = (
    _steady(0.5),
    _steady(0.7),
    _steady(0.9),
    _steady(0.95),
    _day(0.7),
    _day(0.9),
    Scenario(
        "flash-crowd",
        "one region's clients at 3x for 60 s, on a fleet at 60% load",
        0.6,
        crowd=CrowdSpec(at=0.3, seconds=60.0, factor=3.0),
    ),
    Scenario(
        "zone-then-region-lost",
        "at 75% load the largest region loses a zone, then the whole region",
        0.75,
        events=(FleetEvent(0.35, "lose_zone"), FleetEvent(0.6, "lose_region")),
    ),
    Scenario(
        "throttling",
        "at 80% load 10% of GPUs start throttling mid-run",
        0.8,
        events=(FleetEvent(0.4, "throttle", 0.1),),
    ),
    Scenario(
        "tenant-flood",
        "at 70% load one tenant floods at 10x its share for 60 s",
        0.7,
        flood=FloodSpec(at=0.3, seconds=60.0, factor=10.0),
    ),
)


def scenario(name: str) -> Scenario:
    """The scenario called ``name``; ValueError naming the known ones."""
    for s in SCENARIOS:
        if s.name == name:
            return s
    known = ", ".join(s.name for s in SCENARIOS)
    raise ValueError(f"unknown scenario {name!r}; known: {known}")


def target_region(topology: Topology) -> RegionConfig:
    """The region a loss hits: the one with the most GPUs (first on a tie)."""
    return max(topology.regions, key=lambda r: sum(len(z.gpus) for z in r.zones))


def apply(
    event: FleetEvent,
    topology: Topology,
    gpus: Sequence[SimGpu],
    deployment: SimDeployment | None,
    rng: random.Random,
) -> None:
    """Make ``event`` happen to the GPUs and, when routed through tiers, to the tiers."""
    by_name = {g.name: g for g in gpus}
    if event.kind == "throttle":
        chosen = rng.sample(list(gpus), max(1, round(event.fraction * len(gpus))))
        for gpu in chosen:
            gpu.set_speed(gpu.speed * THROTTLED_SPEED)
        return
    region = target_region(topology)
    zones = region.zones[:1] if event.kind == "lose_zone" else region.zones
    for zone in zones:
        for cfg in zone.gpus:
            if by_name[cfg.name].up:
                by_name[cfg.name].fail(event.label(topology))
        if deployment is not None:
            deployment.zones[zone.name].up = False
            deployment.zones[zone.name].publisher.paused = True
    if deployment is not None and event.kind == "lose_region":
        deployment.by_region[region.name].up = False
        deployment.by_region[region.name].publisher.paused = True
