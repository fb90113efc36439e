"""The fleet's answers merged into one tree: regions -> zones -> GPUs.

Pure functions over what ``FleetView`` fetched (``common.operations.fleet_view``):
the global's own state, each inner tier's ``/api/state`` (or why there is none),
and the topology filling in what no tier said. Another process's answer is read
field by field; a value of the wrong type reads as unknown.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.config.topology import Topology


@dataclass
class Fetched:
    """One tier's answer, or why there is none."""

    body: dict[str, Any] | None
    error: str = ""


# Another process's answer, read field by field: a wrong type reads as unknown.
def _number(value: Any) -> int | float | None:
    """A finite number (JSON's NaN and Infinity would not survive the answer), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def _count(value: Any) -> int:
    """A count as protobuf JSON writes it (a number, or a string for 64-bit); 0 if not."""
    try:
        return int(value) if isinstance(value, int | float | str) else 0
    except (ValueError, OverflowError):
        return 0


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _capacity(summary: Any) -> dict[str, Any]:
    """Slots, busy slots, queue and utilisation summed over a summary's models
    (``MessageToDict`` names, zero fields omitted)."""
    if not summary or not isinstance(summary, dict):
        return {"utilisation": None, "queued": None, "slots": None, "healthy_gpus": None}
    slots = busy = queued = healthy = 0
    models = summary.get("models")
    for model in models if isinstance(models, list) else ():
        model = _mapping(model)
        slots += _count(model.get("totalSlots"))
        busy += _count(model.get("busySlots"))
        queued += _count(model.get("queuedRequests"))
        healthy = max(healthy, _count(model.get("healthyGpus")))
    return {
        "utilisation": busy / slots if slots else 0.0,
        "queued": queued,
        "slots": slots,
        "healthy_gpus": healthy,
    }


def _gpu_state(gpu: Mapping[str, Any]) -> str:
    if not gpu.get("healthy"):
        return "down"
    if gpu.get("ejected"):
        return "ejected"
    if gpu.get("drained"):
        return "drained"
    return "ok"


def _gpu(
    cfg_name: str, hardware: str, slots: int, live: Mapping[str, Any] | None
) -> dict[str, Any]:
    if live is None:
        return {"name": cfg_name, "hardware": hardware, "slots": slots, "state": "unknown"}
    slots = _count(live.get("slots")) or slots
    outstanding = max(0, _count(live.get("outstanding_requests")))
    reported = _mapping(live.get("reported"))
    out = {
        "name": cfg_name,
        "hardware": _text(live.get("hardware")) or hardware,
        "slots": slots,
        "state": _gpu_state(live),
        "healthy": bool(live.get("healthy")),
        "outstanding": outstanding,
        "utilisation": min(1.0, outstanding / slots) if slots > 0 else 0.0,
        "running": _number(reported.get("running")),
        "waiting": _number(reported.get("waiting")),
        "kv_cache_usage": _number(reported.get("kv_cache_usage")),
        "last_error": _text(live.get("last_error")),
    }
    # Set by the admin API when present.
    if "drained" in live:
        out["drained"] = bool(live["drained"])
    if _number(live.get("weight")) is not None:
        out["weight"] = live["weight"]
    return out


def _children(state: Fetched | None) -> dict[str, dict[str, Any]]:
    """An answer's children by name (``_get`` checked that ``children`` is a list)."""
    if state is None or state.body is None:
        return {}
    return {
        c["name"]: c
        for c in state.body["children"]
        if isinstance(c, dict) and isinstance(c.get("name"), str)
    }


def _queue(state: Fetched | None) -> dict[str, int] | None:
    """A local tier's queue by priority, or None when it did not say (or said nonsense)."""
    queue = (state.body or {}).get("queue") if state is not None else None
    if not isinstance(queue, dict) or any(_number(v) is None for v in queue.values()):
        return None
    return {k: _count(v) for k, v in queue.items()}


def _seen(child: Mapping[str, Any]) -> dict[str, Any]:
    """What a tier says of one of its children (a region or a zone)."""
    return {
        "healthy": _flag(child.get("healthy")),
        "drained": _flag(child.get("drained")),
        "last_error": _text(child.get("last_error")),
        "outstanding": _number(child.get("outstanding_requests")),
        "summary_age_s": _number(child.get("summary_age_s")),
        **_capacity(child.get("summary")),
    }


def merge_fleet(
    topology: Topology, own: Mapping[str, Any], fetched: Mapping[str, Fetched]
) -> dict[str, Any]:
    """Regions → zones → GPUs from the global's own state and each inner tier's
    (``fetched`` by ``OpsTarget.label``); the topology fills in what no tier said."""
    regions_seen = {c["name"]: c for c in own.get("children", ())}
    regions = []
    totals = {"gpus": 0, "gpus_ok": 0, "slots": 0, "outstanding": 0, "queued": 0}
    for region in topology.regions:
        regional = fetched.get(f"regional {region.name}")
        zones_seen = _children(regional)
        seen = regions_seen.get(region.name, {})
        zones = []
        for zone in region.zones:
            local = fetched.get(f"local {zone.name}")
            gpus_seen = _children(local)
            zone_seen = zones_seen.get(zone.name, {})
            gpus = [
                _gpu(g.name, g.hardware, g.max_concurrency, gpus_seen.get(g.name))
                for g in zone.gpus
            ]
            queue = _queue(local)
            tier_queued = sum(queue.values()) if queue is not None else None
            for g in gpus:
                totals["gpus"] += 1
                totals["gpus_ok"] += g["state"] == "ok"
                totals["slots"] += g["slots"]
                totals["outstanding"] += g.get("outstanding", 0)
                totals["queued"] += max(0, int(g.get("waiting") or 0))
            totals["queued"] += tier_queued or 0
            zones.append(
                {
                    "name": zone.name,
                    **_reach(local),
                    **_seen(zone_seen),
                    "tier_queued": tier_queued,
                    "queue": queue,
                    "gpus": gpus,
                }
            )
        regions.append(
            {
                "name": region.name,
                "location": [region.location.lat, region.location.lon],
                **_reach(regional),
                **_seen(seen),
                "zones": zones,
            }
        )
    slots = totals["slots"]
    return {
        "generated_at": time.time(),
        "global": {"name": own.get("name", "global"), "ready": own.get("ready")},
        "totals": {**totals, "utilisation": totals["outstanding"] / slots if slots else 0.0},
        "regions": regions,
    }


def _reach(state: Fetched | None) -> dict[str, Any]:
    if state is None:
        return {"reachable": None, "ready": None, "error": "no ops_listen"}
    if state.body is None:
        return {"reachable": False, "ready": None, "error": state.error}
    return {"reachable": True, "ready": _flag(state.body.get("ready")), "error": ""}
