"""Policy sets the fleet simulator compares: one picker per tier, by name.

A ``PolicySet`` names how each tier picks: a factory for the global tier's
region picker, one for each regional tier's zone picker, and the local tier's
policy (a key of ``local_lb.policies.POLICIES``). The deployment
(``sim.deployment``) builds the tiers with the real classes and these pickers.

``meridian`` is the servers' own: the same ``region_picker`` and
``zone_picker`` the servers build, and the local ``default`` policy.

Each peer GPU policy is deployed in the two stacks its users deploy it in,
because what sits in front of the GPUs decides more than the GPU algorithm
once some regions are offered more than they can serve:

- geo-DNS (the plain name, e.g. ``nginx_least_conn``): DNS with health
  checks sends each client to the nearest region that is up, with no spill on
  load (``sim.peers.NearestRegionPicker``); across a region's zones each keeps
  its own rule — least loaded by slots, or two random choices for the
  power-of-two and Envoy sets. An overloaded region keeps all of its clients.
- a cloud global load balancer (``<name>_spill``): the nearest region takes
  traffic until this balancer's in-flight requests fill its threshold share of
  the region's reported slots, then the next-nearest takes the overflow
  (``sim.peers.SpillRegionPicker``, GCP's waterfall by region), and between a
  region's zones least outstanding requests (``LeastLoadedChildPicker``), as
  cloud balancers spread over zones.

Both stacks run the same GPU policy; the pair separates the front (where the
overload goes) from the GPU algorithm. Only ``round_robin`` and ``random`` are
applied at every tier, regions included (they stand for a fleet with no
locality at all).

``greedy_clairvoyant`` is not a set of pickers: the simulator serves it with
``sim.greedy.GreedyClairvoyant`` (one central queue over the whole fleet,
placing each request greedily with knowledge no router has); its entry is here
so that every name the simulator accepts is known in one place, and its picker
factories refuse to build anything. It is a reference, not a bound: the bound is
``sim.bound``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from common.config.topology import RegionConfig, Topology
from common.request.pick import Picker
from global_lb.server import region_picker
from local_lb.policies import DEFAULT_POLICY
from regional_lb.server import zone_picker
from sim.peers import (
    SPILL_THRESHOLD,
    LeastLoadedChildPicker,
    NearestRegionPicker,
    RandomChildPicker,
    RoundRobinChildPicker,
    SpillRegionPicker,
)

RegionPickerFactory = Callable[[Topology, random.Random], Picker]
ZonePickerFactory = Callable[[Topology, RegionConfig, random.Random], Picker]

MERIDIAN = "meridian"
GREEDY = "greedy_clairvoyant"


@dataclass(frozen=True)
class PolicySet:
    """How every tier picks under one policy."""

    name: str
    summary: str  # one line for reports
    region_picker: RegionPickerFactory
    zone_picker: ZonePickerFactory
    local_policy: str  # a key of local_lb.policies.POLICIES


def nearest_region(topology: Topology, rng: random.Random) -> Picker:
    """Geo-DNS with health checks in front of the peers."""
    return NearestRegionPicker(
        topology.global_tier.location, topology.summary_ttl_s, rtt_ms=topology.rtt_ms
    )


def spill_region(topology: Topology, rng: random.Random) -> Picker:
    """A cloud global load balancer in front of the peers: spills on capacity."""
    return SpillRegionPicker(
        topology.global_tier.location, topology.summary_ttl_s, rtt_ms=topology.rtt_ms
    )


@dataclass(frozen=True)
class SpillAt:
    """``spill_region`` with the operator's threshold set to ``threshold``."""

    threshold: float

    def __call__(self, topology: Topology, rng: random.Random) -> Picker:
        return SpillRegionPicker(
            topology.global_tier.location,
            topology.summary_ttl_s,
            rtt_ms=topology.rtt_ms,
            threshold=self.threshold,
        )


def least_loaded_zone(topology: Topology, region: RegionConfig, rng: random.Random) -> Picker:
    return LeastLoadedChildPicker(rng, topology.summary_ttl_s)


def two_choices_zone(topology: Topology, region: RegionConfig, rng: random.Random) -> Picker:
    return LeastLoadedChildPicker(rng, topology.summary_ttl_s, p2c=True)


def _greedy_region(topology: Topology, rng: random.Random) -> Picker:
    raise ValueError(
        f"policy {GREEDY!r} has no pickers: serve it with sim.greedy.GreedyClairvoyant"
    )


def _greedy_zone(topology: Topology, region: RegionConfig, rng: random.Random) -> Picker:
    raise ValueError(
        f"policy {GREEDY!r} has no pickers: serve it with sim.greedy.GreedyClairvoyant"
    )


# The fronts, as the reports label them.
GEO_DNS = "geo-DNS, nearest region, no spill on load"
SPILL = f"global LB spilling past {SPILL_THRESHOLD:.0%} of a region's slots, least-request zones"


def _stacks(
    name: str, zone: ZonePickerFactory, zones: str, local: str, gpus: str
) -> tuple[PolicySet, PolicySet]:
    """A peer GPU policy ``local`` in both stacks: behind geo-DNS as ``name`` with its own
    zone rule ``zone`` (described by ``zones``), behind a spilling global balancer with
    least-request zones as ``<name>_spill``; ``gpus`` describes the GPU tier."""
    return (
        PolicySet(name, f"{GEO_DNS}; {zones}, {gpus}", nearest_region, zone, local),
        PolicySet(f"{name}_spill", f"{SPILL}; {gpus}", spill_region, least_loaded_zone, local),
    )


_SETS = (
    PolicySet(
        MERIDIAN,
        "Meridian: regions by RTT + queueing with spill, zones by headroom, GPUs by completion",
        region_picker,
        zone_picker,
        DEFAULT_POLICY,
    ),
    PolicySet(
        GREEDY,
        "greedy clairvoyant: one central queue over the fleet, each request placed where its "
        "own completion is least, knowing every true length and speed (not a bound)",
        _greedy_region,
        _greedy_zone,
        DEFAULT_POLICY,
    ),
    PolicySet(
        "round_robin",
        "round robin at every tier (regions, zones, GPUs)",
        lambda topology, rng: RoundRobinChildPicker(topology.summary_ttl_s, residency=True),
        lambda topology, region, rng: RoundRobinChildPicker(topology.summary_ttl_s),
        "round_robin",
    ),
    PolicySet(
        "random",
        "uniformly random at every tier (regions, zones, GPUs)",
        lambda topology, rng: RandomChildPicker(rng, topology.summary_ttl_s, residency=True),
        lambda topology, region, rng: RandomChildPicker(rng, topology.summary_ttl_s),
        "random",
    ),
    *_stacks(
        "geo_least_conn",
        least_loaded_zone,
        "least-loaded zone",
        "least_connections",
        "least connections per GPU",
    ),
    *_stacks(
        "power_of_two",
        two_choices_zone,
        "two random choices per zone",
        "power_of_two",
        "two random choices per GPU",
    ),
    *_stacks(
        "nginx_least_conn",
        least_loaded_zone,
        "least-loaded zone",
        "weighted_least_connections",
        "nginx least_conn with hardware weights per GPU",
    ),
    *_stacks(
        "envoy_least_request",
        two_choices_zone,
        "two random choices per zone",
        "envoy_least_request",
        "Envoy LEAST_REQUEST per GPU",
    ),
    *_stacks(
        "sglang_cache_aware",
        least_loaded_zone,
        "least-loaded zone",
        "sglang_cache_aware",
        "SGLang's cache-aware router per GPU",
    ),
    *_stacks(
        "inference_gateway",
        least_loaded_zone,
        "least-loaded zone",
        "inference_gateway",
        "inference gateway scorers (2/2/3) per GPU",
    ),
)

POLICY_SETS: Mapping[str, PolicySet] = {s.name: s for s in _SETS}


def policy_set(name: str) -> PolicySet:
    """The set called ``name``; ValueError naming it and every known one.

    A spill stack takes its balancer's threshold after an ``@``:
    ``nginx_least_conn_spill@0.5`` spills past 50 % of a region's slots (the default,
    ``SPILL_THRESHOLD``, is what the plain name runs)."""
    base, at, threshold = name.partition("@")
    found = POLICY_SETS.get(base)
    if found is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_SETS)}")
    if not at:
        return found
    if not base.endswith("_spill"):
        raise ValueError(f"policy {name!r}: only a spill stack (<name>_spill) takes @threshold")
    try:
        value = float(threshold)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"policy {name!r}: the spill threshold must be in (0, 1], got {threshold!r}"
        )
    summary = found.summary.replace(f"{SPILL_THRESHOLD:.0%}", f"{value:.0%}", 1)
    return replace(found, name=name, summary=summary, region_picker=SpillAt(value))
