"""Policy sets the fleet simulator compares: one picker per tier, by name.

A ``PolicySet`` names how each tier picks: a factory for the global tier's
region picker, one for each regional tier's zone picker, and the local tier's
policy (a key of ``local_lb.policies.POLICIES``). The deployment
(``sim.deployment``) builds the tiers with the real classes and these pickers.

``meridian`` is the servers' own: the same ``region_picker`` and
``zone_picker`` the servers build, and the local ``default`` policy.

The peers are deployed as fleets deploy them: the product balances inside a
region, and geo-DNS with health checks sits in front (the nearest region that
is up, no spill on load: ``sim.peers.NearestRegionPicker``). Across a region's
zones each keeps its own rule — least loaded by slots, or two random choices
for the power-of-two and Envoy sets — and at the GPU tier its own policy.
Only ``round_robin`` and ``random`` are applied at every tier, regions
included (they stand for a fleet with no locality at all).

``oracle`` is not a set of pickers: the simulator serves it with
``sim.oracle.Oracle`` (one central queue over the whole fleet); its entry is
here so that every name the simulator accepts is known in one place, and
its picker factories refuse to build anything.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from common.config.topology import RegionConfig, Topology
from common.request.pick import Picker
from global_lb.server import region_picker
from local_lb.policies import DEFAULT_POLICY
from regional_lb.server import zone_picker
from sim.peers import (
    LeastLoadedChildPicker,
    NearestRegionPicker,
    RandomChildPicker,
    RoundRobinChildPicker,
)

RegionPickerFactory = Callable[[Topology, random.Random], Picker]
ZonePickerFactory = Callable[[Topology, RegionConfig, random.Random], Picker]

MERIDIAN = "meridian"
ORACLE = "oracle"


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


def least_loaded_zone(topology: Topology, region: RegionConfig, rng: random.Random) -> Picker:
    return LeastLoadedChildPicker(rng, topology.summary_ttl_s)


def two_choices_zone(topology: Topology, region: RegionConfig, rng: random.Random) -> Picker:
    return LeastLoadedChildPicker(rng, topology.summary_ttl_s, p2c=True)


def _oracle_region(topology: Topology, rng: random.Random) -> Picker:
    raise ValueError("policy 'oracle' has no pickers: serve it with sim.oracle.Oracle")


def _oracle_zone(topology: Topology, region: RegionConfig, rng: random.Random) -> Picker:
    raise ValueError("policy 'oracle' has no pickers: serve it with sim.oracle.Oracle")


def _behind_geo_dns(name: str, summary: str, zone: ZonePickerFactory, local: str) -> PolicySet:
    return PolicySet(name, summary, nearest_region, zone, local)


_SETS = (
    PolicySet(
        MERIDIAN,
        "Meridian: regions by RTT + queueing with spill, zones by headroom, GPUs by completion",
        region_picker,
        zone_picker,
        DEFAULT_POLICY,
    ),
    PolicySet(
        ORACLE,
        "oracle: one central queue over the fleet, perfect knowledge, least true completion",
        _oracle_region,
        _oracle_zone,
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
    _behind_geo_dns(
        "geo_least_conn",
        "geo-DNS nearest region, least-loaded zone, least connections per GPU",
        least_loaded_zone,
        "least_connections",
    ),
    _behind_geo_dns(
        "power_of_two",
        "geo-DNS nearest region, two random choices per zone and per GPU",
        two_choices_zone,
        "power_of_two",
    ),
    _behind_geo_dns(
        "nginx_least_conn",
        "geo-DNS nearest region, least-loaded zone, nginx least_conn with hardware weights",
        least_loaded_zone,
        "weighted_least_connections",
    ),
    _behind_geo_dns(
        "envoy_least_request",
        "geo-DNS nearest region, two random choices per zone, Envoy LEAST_REQUEST per GPU",
        two_choices_zone,
        "envoy_least_request",
    ),
    _behind_geo_dns(
        "sglang_cache_aware",
        "geo-DNS nearest region, least-loaded zone, SGLang's cache-aware router per GPU",
        least_loaded_zone,
        "sglang_cache_aware",
    ),
    _behind_geo_dns(
        "inference_gateway",
        "geo-DNS nearest region, least-loaded zone, inference gateway scorers (2/2/3) per GPU",
        least_loaded_zone,
        "inference_gateway",
    ),
)

POLICY_SETS: Mapping[str, PolicySet] = {s.name: s for s in _SETS}


def policy_set(name: str) -> PolicySet:
    """The set called ``name``; ValueError naming it and every known one."""
    found = POLICY_SETS.get(name)
    if found is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_SETS)}")
    return found
