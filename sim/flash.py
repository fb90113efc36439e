"""Herding under a flash crowd: does the crowded region's share of traffic settle?

A router that sends each request to the region that looked best in the last
summary moves the crowd as a block: the region's share jumps up, its summary
turns bad, the share falls, and so on at the summary cadence. ``herding_of``
measures that as the standard deviation of the crowded region's per-bucket
share of the served traffic during the crowd, and the largest change between
two consecutive buckets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sim.results import Herding, Timeline
from sim.stats import swing

if TYPE_CHECKING:
    from sim.timeline import Columns

CROWD_WORD = "crowd"
# How long a crowd whose label gives no "for N s" lasts: the flash crowd.
CROWD_S = 60.0
_FOR_SECONDS = re.compile(r"\bfor\s+(\d+(?:\.\d+)?)\s*s\b")
BEFORE_S = 60.0  # arrivals this long before the crowd give each home region's usual share


@dataclass(frozen=True)
class Crowd:
    """A flash crowd: ``region``'s clients arrive in excess from ``start_s`` to ``end_s``."""

    region: str
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not self.end_s > self.start_s:
            raise ValueError(
                f"Crowd.end_s ({self.end_s}) must be after Crowd.start_s ({self.start_s})"
            )


def herding_of(timeline: Timeline, crowd: Crowd) -> Herding | None:
    """The crowded region's share over the buckets wholly inside the crowd; None when
    the region served nothing in the run or no bucket lies inside."""
    shares = timeline.region_share.get(crowd.region)
    if shares is None:
        return None
    inside = [
        shares[i]
        for i in range(len(shares))
        if timeline.time_s(i) >= crowd.start_s - 1e-9
        and timeline.time_s(i) + timeline.bucket_s <= crowd.end_s + 1e-9
    ]
    moved = swing(inside)
    if moved is None:
        return None
    return Herding(
        region=crowd.region,
        start_s=crowd.start_s,
        end_s=crowd.end_s,
        share_mean=round(moved.mean, 4),
        share_std=round(moved.std, 4),
        max_swing=round(moved.max_swing, 4),
    )


def crowd_from_events(
    events: Sequence[tuple[float, str]], *, end_s: float, homes: Columns
) -> Crowd | None:
    """The first event whose label says "crowd" starts one. It lasts as long as the
    label says ("… for 60 s"), else ``CROWD_S``, but no longer than until the next
    event or ``end_s``. Its region is the home region the label names (the longest
    name found), else the one whose share of the arrivals rose most against the
    ``BEFORE_S`` before. ``homes`` labels each route with its home region."""
    ordered = sorted(events)
    for i, (at, label) in enumerate(ordered):
        if CROWD_WORD not in label.lower():
            continue
        told = _FOR_SECONDS.search(label)
        stop = min(
            at + (float(told.group(1)) if told else CROWD_S),
            ordered[i + 1][0] if i + 1 < len(ordered) else end_s,
            end_s,
        )
        if stop <= at:
            continue
        named = [r for r in set(homes.label_of_route) if r and r.lower() in label.lower()]
        region = max(named, key=len) if named else _rose_most(homes, at, stop)
        return None if region is None else Crowd(region, at, stop)
    return None


def _rose_most(homes: Columns, start_s: float, end_s: float) -> str | None:
    """The home region whose share of the arrivals in [start_s, end_s) rose most over
    its share in the ``BEFORE_S`` before."""
    regions = sorted(set(homes.label_of_route))
    index = [regions.index(r) for r in homes.label_of_route]
    before, during = [0] * len(regions), [0] * len(regions)
    for at, route in zip(homes.at, homes.route, strict=True):
        if start_s - BEFORE_S <= at < start_s:
            before[index[route]] += 1
        elif start_s <= at < end_s:
            during[index[route]] += 1
    if not sum(during):
        return None
    b_total, d_total = max(1, sum(before)), sum(during)
    rise = [d / d_total - b / b_total for b, d in zip(before, during, strict=True)]
    best = max(range(len(regions)), key=lambda r: (rise[r], regions[r]))
    return regions[best] if math.isfinite(rise[best]) else None
