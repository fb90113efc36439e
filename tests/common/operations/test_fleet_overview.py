"""The dashboard's compact view of the merged fleet (aggregates and the packed heat map),
the part of it a drill-down asks for, and both served by the global's fleet view."""

from __future__ import annotations

import json
from typing import Any

from common.operations.fleet_merge import Fetched, merge_fleet
from common.operations.fleet_overview import STATE_CODES, gpu_aggregates, heat, overview, part
from tests.common.operations.test_fleet_view import (
    EU,
    EU_ZONE,
    TOPOLOGY,
    US,
    US_ZONE,
    InnerTier,
    child,
    fleet_view,
    global_ops,
    local_state,
    own_state,
    summary,
)


def merged() -> dict[str, Any]:
    """US: one GPU busy 12/16 with 4 waiting, one ejected; EU: its local tier silent."""
    gpu0, gpu1 = (g.name for g in US_ZONE.gpus)
    fetched = {
        f"regional {US.name}": Fetched(
            {
                "ready": True,
                "children": [
                    child(US_ZONE.name, summary=summary(32, 8, 3), summary_age_s=0.123456)
                ],
            }
        ),
        f"local {US_ZONE.name}": local_state(
            US_ZONE.name,
            [
                child(
                    gpu0,
                    hardware="H100",
                    slots=16,
                    outstanding_requests=12,
                    reported={"running": 12, "waiting": 4, "kv_cache_usage": 0.5},
                ),
                child(gpu1, hardware="A100", slots=16, ejected=True, outstanding_requests=1),
            ],
        ),
        f"local {EU_ZONE.name}": Fetched(None, "TimeoutError"),
    }
    return merge_fleet(TOPOLOGY, own_state(), fetched)


def test_zone_and_region_aggregates() -> None:
    view = overview(merged())
    us, eu = view["regions"]
    zone = us["zones"][0]
    # Local queue 0 + 2 + 1 (local_state) and 4 waiting on the GPU.
    assert (zone["gpus"], zone["serving"], zone["queued"], zone["tier_queued"]) == (2, 1, 7, 3)
    assert zone["states"] == {"ok": 1, "ejected": 1}
    assert (zone["slots"], zone["serving_slots"], zone["outstanding"]) == (32, 16, 13)
    assert zone["load"] == 13 / 32
    assert zone["summary_age_s"] == 0.123  # rounded: what the page shows, not 17 digits
    assert zone["summary"] == {"utilisation": 0.25, "queued": 3, "slots": 32, "healthy_gpus": 2}
    # A region adds up its zones.
    assert {k: us[k] for k in ("gpus", "serving", "queued", "load")} == {
        "gpus": 2,
        "serving": 1,
        "queued": 7,
        "load": 13 / 32,
    }
    # The silent zone: its GPUs unknown, counted in GPUs and slots but not in load.
    silent = eu["zones"][0]
    assert silent["reachable"] is False and silent["error"] == "TimeoutError"
    assert (silent["gpus"], silent["serving"], silent["load"], silent["queued"]) == (2, 0, None, 0)
    assert silent["states"] == {"unknown": 2}
    totals = view["totals"]
    assert (totals["gpus"], totals["serving"], totals["slots"]) == (4, 1, 64)
    assert totals["load"] == 13 / 32  # over the slots a tier reported on
    assert totals["states"] == {"ok": 1, "ejected": 1, "unknown": 2}


def test_heat_map_cells_are_packed_per_zone() -> None:
    view = overview(merged())
    us_heat = view["regions"][0]["zones"][0]["heat"]
    assert us_heat["prefix"] == US_ZONE.name + "-"
    assert [us_heat["prefix"] + n for n in us_heat["names"]] == [g.name for g in US_ZONE.gpus]
    assert us_heat["states"] == "oe"
    assert us_heat["load"] == [75, 6]  # 12/16 and 1/16, in whole percent, half up
    eu_heat = view["regions"][1]["zones"][0]["heat"]
    assert eu_heat["states"] == "uu" and eu_heat["load"] == [None, None]


def test_heat_map_names_keep_what_no_prefix_covers() -> None:
    gpus = [
        {"name": "z-a", "state": "down", "utilisation": 0.0},
        {"name": "odd", "state": "drained", "utilisation": 0.125},
        {"name": "z-c", "state": "mystery"},
    ]
    cells = heat("z", gpus)
    assert cells == {
        "prefix": "",
        "names": ["z-a", "odd", "z-c"],
        "states": "dnu",
        "load": [0, 13, None],
    }
    assert heat("z", [])["names"] == []
    assert set(STATE_CODES.values()) == set("odenu")  # one letter each, as the page reads them


def test_aggregates_read_odd_fields_as_nothing() -> None:
    odd = {"state": "ok", "slots": "16", "outstanding": True, "waiting": "3"}
    agg = gpu_aggregates([odd, {"state": "down", "slots": 8, "waiting": float("nan")}, {}])
    assert (agg["gpus"], agg["serving"], agg["slots"], agg["outstanding"]) == (3, 1, 8, 0)
    assert agg["load"] == 0.0 and agg["queued"] == 0
    assert agg["states"] == {"ok": 1, "down": 1, "unknown": 1}


def test_part_is_one_zone_or_one_region() -> None:
    fleet = merged()
    zone = part(fleet, zone=EU_ZONE.name)
    assert zone is not None
    assert [(r["name"], [z["name"] for z in r["zones"]]) for r in zone["regions"]] == [
        (EU.name, [EU_ZONE.name])
    ]
    assert zone["regions"][0]["zones"][0] == fleet["regions"][1]["zones"][0]
    region = part(fleet, region=US.name)
    assert region is not None and region["regions"] == [fleet["regions"][0]]
    assert part(fleet, zone="nowhere") is None
    assert part(fleet, region=US.name, zone=EU_ZONE.name) is None  # not in that region


async def test_served_overview_drill_down_and_compression() -> None:
    gpu = EU_ZONE.gpus[0].name
    tiers = {
        f"regional {US.name}": None,
        f"local {US_ZONE.name}": None,
        f"regional {EU.name}": None,
        f"local {EU_ZONE.name}": InnerTier(
            "ok", {"ready": True, "children": [child(gpu, slots=16)], "queue": {}}
        ),
    }
    async with fleet_view(tiers, global_ops()) as (client, _):
        reply = await client.get("/api/fleet/overview", headers={"Accept-Encoding": "identity"})
        assert reply.status == 200 and "Content-Encoding" not in reply.headers
        text = await reply.text()
        view = json.loads(text)
        assert text == json.dumps(view, separators=(",", ":"))  # no spaces
        assert [z["heat"]["states"] for r in view["regions"] for z in r["zones"]] == ["uu", "ou"]
        reply = await client.get(f"/api/fleet?zone={EU_ZONE.name}")
        body = await reply.json()
        assert reply.status == 200
        assert [g["name"] for r in body["regions"] for z in r["zones"] for g in z["gpus"]] == [
            g.name for g in EU_ZONE.gpus
        ]
        reply = await client.get(f"/api/fleet?region={US.name}")
        assert [r["name"] for r in (await reply.json())["regions"]] == [US.name]
        reply = await client.get("/api/fleet?zone=nowhere")
        assert reply.status == 404 and (await reply.json()) == {
            "error": "the fleet has no zone 'nowhere'"
        }
        reply = await client.get("/api/fleet?region=nowhere")
        assert reply.status == 404
        # Compressed for a client that asks (aiohttp's client does, and decodes it).
        reply = await client.get("/api/fleet", headers={"Accept-Encoding": "gzip"})
        assert reply.headers["Content-Encoding"] == "gzip"
        assert len((await reply.json())["regions"]) == 2
