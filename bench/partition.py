"""Partitions between hosts under load (issue 12, item 5): what ``make multihost`` runs.

The fleet runs across Linux network namespaces, one per host (``tests.multihost``): the
global host, one host per region (its regional tier, local tiers and emulated GPUs) and a
host for Redis. A client beside region A sends paced load through the global tier; the
link between the global host and A's host is cut silently (every process keeps running,
no RST, no FIN), held, and healed; this is repeated, then A's host is cut from its Redis.
Prints a per-second timeline (requests by serving region, failures) and the figures, and
writes ``bench/results/partition.{json,md}``. Needs root; elsewhere it says why and stops.

    .venv/bin/python -m bench.partition                  # 3 regions, 3 partitions of 10 s
    .venv/bin/python -m bench.partition --regions 2 --repeats 1 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import machine, revision, write_json_and_markdown
from tests.multihost.fleet import FleetShape, MultiHostFleet
from tests.multihost.hosts import unavailable
from tests.multihost.scenario import GRACE_S, PartitionRun, Phases, partition, redis_cut

RESULTS = Path(__file__).resolve().parent / "results"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.partition", description=__doc__)
    p.add_argument("--regions", type=int, default=3, help="2 or 3 (the demo's regions)")
    p.add_argument("--region", default="us-east", help="the region to cut off")
    p.add_argument("--repeats", type=int, default=3, help="partitions, one after another")
    p.add_argument("--cut-s", type=float, default=10.0, help="how long each partition lasts")
    p.add_argument("--rate", type=float, default=60.0, help="requests a second (4 clients)")
    p.add_argument("--failback-window-s", type=float, default=10.0)
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def ramp_points(run: PartitionRun, before_share: float) -> dict[str, float | None]:
    """Seconds after the heal until the region's share first reached 50 % and 90 % of
    what it had before the cut (1-second buckets)."""
    out: dict[str, float | None] = {"half_s": None, "ninety_s": None}
    for t, share in run.share_after_heal():
        if out["half_s"] is None and share >= 0.5 * before_share:
            out["half_s"] = t + 1.0
        if out["ninety_s"] is None and share >= 0.9 * before_share:
            out["ninety_s"] = t + 1.0
    return out


def one_partition(fleet: MultiHostFleet, args: argparse.Namespace) -> dict[str, Any]:
    after = args.failback_window_s + 4.0
    phases = Phases(before_s=4.0, cut_s=args.cut_s, after_s=after, rate_per_s=args.rate)
    run = partition(fleet, args.region, phases)
    figures = run.figures()
    total_before = figures["requests_2s_before_cut"] or 1
    before_share = figures["served_by_cut_region_before_cut"] / total_before
    figures["share_before_cut"] = round(before_share, 3)
    figures.update(ramp_points(run, before_share))
    figures["timeline"] = [[t, c] for t, c in run.timeline]
    figures["cut_at_s"] = phases.before_s
    figures["heal_at_s"] = round(run.heal - run.cut + phases.before_s, 3)
    return figures


def print_timeline(figures: dict[str, Any], regions: list[str]) -> None:
    print(f"  t(s)  {'  '.join(f'{r:>9}' for r in regions)}  failed")
    for t, count in figures["timeline"]:
        mark = ""
        if figures["cut_at_s"] <= t < figures["cut_at_s"] + 1:
            mark = "  <- link cut"
        elif figures["heal_at_s"] - 1 < t <= figures["heal_at_s"]:
            mark = "  <- healed during this second"
        cells = "  ".join(f"{count.get(r, 0):>9}" for r in regions)
        print(f"{t:6.1f}  {cells}  {count.get('FAILED', 0):>6}{mark}")


def summary(parts: list[dict[str, Any]], redis: dict[str, Any]) -> dict[str, Any]:
    moved = [p["moved_s"] for p in parts if p["moved_s"] is not None]
    return {
        "partitions": len(parts),
        "moved_s_max": max(moved, default=None),
        "moved_s_median": statistics.median(moved) if moved else None,
        "in_flight_at_cut": sum(p["in_flight_at_cut"] for p in parts),
        "in_flight_at_cut_failed": sum(p["in_flight_at_cut_failed"] for p in parts),
        "in_flight_answered_s_max": max(p["in_flight_at_cut_answered_s"] for p in parts),
        "failures_first_2s": sum(p["failures_first_2s"] for p in parts),
        "failures_after_2s": sum(p["failures_after_2s"] for p in parts),
        "requests": sum(p["requests"] for p in parts),
        "usage_records": sum(p["usage_records"] for p in parts),
        "ramp_half_s": [p["half_s"] for p in parts],
        "ramp_ninety_s": [p["ninety_s"] for p in parts],
        "redis_cut_failures": redis["failures"],
        "redis_cut_served_by_region": redis["served_by_region_during_cut"],
        "redis_cut_requests": redis["requests_during_cut"],
        "redis_cut_zone_summaries": redis["zone_summaries_during_cut"],
        "redis_summaries_resumed_s": redis["summaries_resumed_s"],
    }


def markdown(result: dict[str, Any]) -> str:
    s, meta, parts = result["summary"], result["meta"], result["partitions"]
    regions = meta["regions"]
    lines = [
        "# Partitions between hosts (`make multihost`, `python -m bench.partition`)",
        "",
        f"{meta['machine']['date']}, commit {meta['revision']['commit']}, "
        f"{meta['machine']['nproc']} cores shared with other work (load average "
        f"{meta['loadavg_1m_before']:.1f} before, {meta['loadavg_1m_after']:.1f} after). "
        "Hosts are network "
        f"namespaces; {len(regions)} regions x 1 zone x 2 emulated GPUs; a client beside "
        f"{meta['region']} at {meta['rate']:g} requests/s; the global—{meta['region']} link "
        f"cut silently for {meta['cut_s']:g} s, {s['partitions']} times; "
        f"failback_window_s {meta['failback_window_s']:g}; "
        + ("a Redis per region." if meta["redis_per_region"] else "one Redis for all regions."),
        "",
        "| what | result | goal |",
        "|---|---|---|",
        f"| cut → answers flowing from other regions (max / median of {s['partitions']}) | "
        f"{s['moved_s_max']} s / {s['moved_s_median']} s | ≤ 2 s |",
        f"| requests in flight at the cut: failed / answered elsewhere by | "
        f"{s['in_flight_at_cut_failed']} of {s['in_flight_at_cut']} / "
        f"{s['in_flight_answered_s_max']} s | 0 |",
        f"| failed requests, first {GRACE_S:g} s of the cut / after | "
        f"{s['failures_first_2s']} / {s['failures_after_2s']} | – / 0 |",
        f"| usage records / requests | {s['usage_records']} / {s['requests']} | equal |",
        f"| after the heal, the region back to 50 % / 90 % of its share (s) | "
        f"{s['ramp_half_s']} / {s['ramp_ninety_s']} | gradual |",
        f"| region cut from its Redis: failures / requests it served of all | "
        f"{s['redis_cut_failures']} / {s['redis_cut_served_by_region']} of "
        f"{s['redis_cut_requests']} | 0 / – |",
        f"| ... its capacity summaries written during that cut / resumed after the heal | "
        f"{s['redis_cut_zone_summaries']} / {s['redis_summaries_resumed_s']} s | 0 / – |",
        "",
        "## First partition, second by second (requests started, by serving region)",
        "",
        f"t: seconds since the load began; the cut at t = {parts[0]['cut_at_s']:g}, the heal "
        f"at t = {parts[0]['heal_at_s']:g}. The 4 clients wait for their answers, so a "
        "second with no start is one in which every client was held up by the cut.",
        "",
        "| t (s) | " + " | ".join(regions) + " | failed | |",
        "|---" * (len(regions) + 3) + "|",
    ]
    first = parts[0]
    for t, count in first["timeline"]:
        mark = "cut" if first["cut_at_s"] <= t < first["cut_at_s"] + 1 else ""
        mark = "healed" if first["heal_at_s"] - 1 < t <= first["heal_at_s"] else mark
        cells = " | ".join(str(count.get(r, 0)) for r in regions)
        lines.append(f"| {t:g} | {cells} | {count.get('FAILED', 0)} | {mark} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = FleetShape(regions=args.regions, failback_window_s=args.failback_window_s)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="meridian-multihost-") as tmp:
        fleet = MultiHostFleet(Path(tmp), shape)
        try:
            started = time.monotonic()
            fleet.start()
            print(f"fleet up on {len(fleet.hosts.hosts)} hosts in "
                  f"{time.monotonic() - started:.1f} s", flush=True)  # fmt: skip
            parts = []
            for i in range(args.repeats):
                parts.append(one_partition(fleet, args))
                print(f"partition {i + 1}: moved in {parts[-1]['moved_s']} s", flush=True)
            redis = redis_cut(fleet, args.region, Phases(3.0, 6.0, 6.0, args.rate)).figures()
            regions = list(fleet.regions)
        finally:
            fleet.stop()
    settings = {k: vars(args)[k] for k in ("region", "rate", "cut_s", "failback_window_s")}
    # The machine is shared: its load says how far the figures are the fleet's own.
    busy = {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}
    meta = {"machine": machine(), "revision": revision(), "regions": regions, **settings, **busy,
            "redis_per_region": shape.redis_per_region}  # fmt: skip
    return {"meta": meta, "summary": summary(parts, redis), "partitions": parts, "redis": redis}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    reason = unavailable()
    if reason:
        print(f"bench.partition skipped: {reason}", file=sys.stderr)
        return 0
    result = run(args)
    print_timeline(result["partitions"][0], result["meta"]["regions"])
    print(json.dumps(result["summary"], indent=2))
    if not args.no_write:
        write_json_and_markdown(RESULTS, "partition", result, markdown(result))
        print(f"wrote {RESULTS / 'partition.json'} and {RESULTS / 'partition.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
