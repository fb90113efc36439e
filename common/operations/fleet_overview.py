"""The merged fleet cut down for the dashboard: aggregates and a heat map, and one
part of it in full on demand.

``merge_fleet`` (``common.operations.fleet_merge``) answers with every GPU in full,
about 300 bytes each: fine for ``meridian top`` and 24 GPUs, some 350 KB a second for
1024. The dashboard reads ``overview`` instead, ``/api/fleet/overview``: per region
and zone the aggregates it shows (GPUs serving of all, load, queue, capacity, the age
of the capacity summary the tier above routes on), and per GPU only what a heat-map
cell needs, packed per zone:

* ``heat.prefix`` + ``heat.names[i]``: the GPU's name (the zone's name and a dash
  are said once, not per GPU, when every name there starts with them);
* ``heat.states[i]``: one letter, ``STATE_CODES`` (``o`` ok, ``d`` down, ``e``
  ejected, ``n`` drained, ``u`` unknown);
* ``heat.load[i]``: requests in flight over slots, in whole percent (None: unknown).

A click on a zone or region asks for that part in full (``part``: ``/api/fleet``
with ``?zone=`` or ``?region=``), the same shape as the whole fleet.

Aggregates count what the tiers reported: ``load`` is requests in flight over the
slots of the GPUs a local tier reported on (a GPU shown unknown adds nothing), and
``capacity`` is the slots of the GPUs serving (state ok) out of all slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

STATE_CODES: Mapping[str, str] = {
    "ok": "o",
    "down": "d",
    "ejected": "e",
    "drained": "n",
    "unknown": "u",
}
# What a tier said of a region or zone (its reachability, health, summary), kept as is.
_SAID = (
    "reachable",
    "ready",
    "error",
    "healthy",
    "drained",
    "last_error",
    "summary_age_s",
)
_COUNTS = (
    "gpus",
    "serving",
    "slots",
    "serving_slots",
    "reported_slots",
    "outstanding",
    "waiting",
    "queued",
)
# The capacity summary the tier above routes on, as fleet_merge read it.
_SUMMARY = ("utilisation", "queued", "slots", "healthy_gpus")


def _int(value: Any) -> int:
    """A count as fleet_merge wrote it (an int; a GPU's ``waiting`` may be a float, and
    None when unknown); anything else counts 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return 0
    return int(value)


def gpu_aggregates(gpus: Iterable[Mapping[str, Any]], tier_queued: int = 0) -> dict[str, Any]:
    """GPUs serving of all, by state, load, queue and capacity over ``gpus``."""
    gpus = list(gpus)
    states: dict[str, int] = {}
    slots = serving_slots = reported_slots = outstanding = waiting = 0
    for gpu in gpus:
        state = gpu.get("state", "unknown")
        states[state] = states.get(state, 0) + 1
        size = _int(gpu.get("slots"))
        slots += size
        if state == "ok":
            serving_slots += size
        if state != "unknown":
            reported_slots += size
            outstanding += _int(gpu.get("outstanding"))
            waiting += _int(gpu.get("waiting"))
    return {
        "gpus": len(gpus),
        "serving": states.get("ok", 0),
        "states": states,
        "slots": slots,
        "serving_slots": serving_slots,
        "outstanding": outstanding,
        "reported_slots": reported_slots,
        "load": outstanding / reported_slots if reported_slots else None,
        "waiting": waiting,
        "queued": waiting + tier_queued,
    }


def _sum(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregates of several zones (or regions) as one."""
    states: dict[str, int] = {}
    for part in parts:
        for state, n in part["states"].items():
            states[state] = states.get(state, 0) + n
    out: dict[str, Any] = {k: sum(p[k] for p in parts) for k in _COUNTS}
    reported = out["reported_slots"]
    out.update(states=states, load=out["outstanding"] / reported if reported else None)
    return out


def heat(zone: str, gpus: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One zone's heat-map cells, packed (module docstring)."""
    names = [str(g.get("name", "")) for g in gpus]
    prefix = zone + "-"
    if not names or not all(n.startswith(prefix) and len(n) > len(prefix) for n in names):
        prefix = ""
    load: list[int | None] = []
    for gpu in gpus:
        u = gpu.get("utilisation")
        if isinstance(u, bool) or not isinstance(u, int | float) or gpu.get("state") == "unknown":
            load.append(None)
        else:
            load.append(int(100 * u + 0.5))  # half up, as the page rounds its percentages
    return {
        "prefix": prefix,
        "names": [n[len(prefix) :] for n in names],
        "states": "".join(STATE_CODES.get(g.get("state", "unknown"), "u") for g in gpus),
        "load": load,
    }


def _rounded(value: Any, digits: int) -> Any:
    """Floats cut to what the page shows (a 17-digit age is bytes for nothing)."""
    return round(value, digits) if isinstance(value, float) else value


def _said(part: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **{k: _rounded(part.get(k), 3) for k in _SAID},
        "summary": {k: _rounded(part.get(k), 4) for k in _SUMMARY},
    }


def _zone(zone: Mapping[str, Any]) -> dict[str, Any]:
    gpus = list(zone.get("gpus", ()))
    tier_queued = zone.get("tier_queued")
    return {
        "name": zone["name"],
        **_said(zone),
        "tier_queued": tier_queued,
        **gpu_aggregates(gpus, _int(tier_queued)),
        "heat": heat(zone["name"], gpus),
    }


def _region(region: Mapping[str, Any]) -> dict[str, Any]:
    zones = [_zone(z) for z in region.get("zones", ())]
    return {
        "name": region["name"],
        "location": region.get("location"),
        **_said(region),
        **_sum(zones),
        "zones": zones,
    }


def overview(fleet: Mapping[str, Any]) -> dict[str, Any]:
    """The dashboard's compact view of a merged fleet (module docstring)."""
    regions = [_region(r) for r in fleet.get("regions", ())]
    return {
        "generated_at": fleet.get("generated_at"),
        "global": fleet.get("global"),
        "totals": _sum(regions),
        "regions": regions,
    }


def part(
    fleet: Mapping[str, Any], *, region: str | None = None, zone: str | None = None
) -> dict[str, Any] | None:
    """The merged fleet cut to one region, or to one zone (in its region); None when
    the fleet has no such region or zone."""
    kept = []
    for r in fleet.get("regions", ()):
        if region is not None and r["name"] != region:
            continue
        zones = [z for z in r.get("zones", ()) if zone is None or z["name"] == zone]
        if zones:
            kept.append({**r, "zones": zones})
    if not kept:
        return None
    return {**fleet, "regions": kept}
