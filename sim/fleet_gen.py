"""Generated fleets: ``meridian sim fleet --gpus 1024 --regions 6`` as a topology mapping.

The mapping is what ``common.config.topology.topology_from_mapping`` reads and
what ``meridian up`` could start (every address ``127.0.0.1:0``: the launcher
picks free ports). How it is laid out, deterministically for a seed:

- regions: the first ``regions`` of ``sim.geography.CLOUD_REGIONS`` at their real
  coordinates; each gets one GPU, the rest by the regions' ``gpu_weight``
  (largest remainder), so the US and EU regions are the big ones; or, sized to
  demand, by the peak over a day of their clients' share of the traffic
  (``sim.regional_load.day_peak_shares``: the cities nearest each region), so a
  region whose clients peak at once holds what their evening asks of it;
- zones: 3 in a region whose ``gpu_weight`` is at least ``THREE_ZONE_WEIGHT``, 2
  elsewhere (never more zones than the region has GPUs), near the region's
  coordinates; GPUs split over them by seeded weights in [0.8, 1.2], at least one each;
- hardware: exact counts from the mix (largest remainder; default V100 10%,
  A100 40%, H100 40%, H200 10%), shuffled over the fleet, so every zone is mixed;
- throttling: exactly ``floor(gpus × throttled_fraction + 0.5)`` GPUs (5% by
  default), chosen at random, with ``throttle: 0.8``;
- ``max_concurrency`` per class (``MAX_CONCURRENCY``): as many conversation-shaped
  requests as fit the class's KV cache at once, each reserving the published
  mean prompt + output, 1155 + 211 = 1366 tokens: V100 16 384 // 1366 = 11,
  A100 65 536 // 1366 = 47, H100 81 920 // 1366 = 59, H200 131 072 // 1366 = 95.

No ``auth`` section: tenants in a topology need API-key digests, and a generated
file must not carry keys; the simulator's tenants and their weights come from
the workload (``sim.workload.TenantMix``).
"""

from __future__ import annotations

import math
import random
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from common.config.gpu import HARDWARE_KV_TOKENS, HARDWARE_SPEED
from sim.geography import CITIES, CLOUD_REGIONS, CloudRegion
from sim.regional_load import day_peak_shares
from sim.requests import SIM_MODEL
from sim.shapes import CONVERSATION

DEFAULT_HARDWARE_MIX: Mapping[str, float] = MappingProxyType(
    {"V100": 0.10, "A100": 0.40, "H100": 0.40, "H200": 0.10}
)
THROTTLE = 0.8
THREE_ZONE_WEIGHT = 2.0
ANY_PORT = "127.0.0.1:0"
BATCH_RESERVATION_TOKENS = round(
    CONVERSATION.prompt.published.mean + CONVERSATION.output.published.mean
)
MAX_CONCURRENCY: Mapping[str, int] = MappingProxyType(
    {hw: kv // BATCH_RESERVATION_TOKENS for hw, kv in HARDWARE_KV_TOKENS.items()}
)


def apportion(total: int, weights: Sequence[float], minimum: int = 0) -> list[int]:
    """Split ``total`` by ``weights`` (largest remainder, ties to the earlier), after
    giving each part ``minimum``; the parts sum to ``total``."""
    rest = total - minimum * len(weights)
    scale = sum(weights)
    quotas = [rest * w / scale for w in weights]
    parts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (parts[i] - quotas[i], i))
    for i in by_remainder[: rest - sum(parts)]:
        parts[i] += 1
    return [minimum + p for p in parts]


def throttled_count(gpus: int, fraction: float) -> int:
    """GPUs throttled in a fleet: the fraction rounded half up (1024 × 5% = 51.2 -> 51)."""
    return math.floor(gpus * fraction + 0.5)


def parse_hardware_mix(text: str) -> dict[str, float]:
    """``--hardware-mix V100=0.1,A100=0.4,...`` as a mapping (checked by ``fleet_mapping``)."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        try:
            mix[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(
                f"--hardware-mix: expected CLASS=FRACTION pairs separated by commas "
                f"(e.g. V100=0.1,A100=0.4,H100=0.4,H200=0.1), got {text!r}"
            )
    return mix


def _check(
    gpus: int, regions: int, model: str, throttled_fraction: float, mix: Mapping[str, float]
) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus!r}")
    if isinstance(regions, bool) or not isinstance(regions, int):
        raise ValueError(f"--regions must be an integer, got {regions!r}")
    if not 1 <= regions <= len(CLOUD_REGIONS):
        raise ValueError(f"--regions must be between 1 and {len(CLOUD_REGIONS)}, got {regions}")
    if regions > gpus:
        raise ValueError(
            f"--regions {regions} needs at least {regions} GPUs (one per region), "
            f"got --gpus {gpus}; lower --regions or raise --gpus"
        )
    if not model or "@" in model:
        raise ValueError(f"--model must be a model name without '@version', got {model!r}")
    if not 0 <= throttled_fraction <= 1:
        raise ValueError(f"--throttled-fraction must be between 0 and 1, got {throttled_fraction}")
    unknown = sorted(set(mix) - set(HARDWARE_SPEED))
    if unknown:
        raise ValueError(
            f"--hardware-mix: unknown hardware class {unknown[0]!r}; "
            f"known: {', '.join(sorted(HARDWARE_SPEED))}"
        )
    for name, share in mix.items():
        if not (math.isfinite(share) and share >= 0):
            raise ValueError(f"--hardware-mix: {name} must be a fraction >= 0, got {share}")
    if not sum(mix.values()) > 0:
        raise ValueError("--hardware-mix: the fractions sum to 0; give some class a share > 0")


def fleet_mapping(
    *,
    gpus: int,
    regions: int,
    seed: int,
    model: str = SIM_MODEL,
    throttled_fraction: float = 0.05,
    hardware_mix: Mapping[str, float] | None = None,
    sized_to_demand: bool = False,
) -> dict[str, Any]:
    """A topology mapping for ``gpus`` GPUs in ``regions`` regions (module docstring);
    ``ValueError`` naming the flag to fix on bad input. ``sized_to_demand`` splits the
    GPUs over regions by their clients' peak demand instead of their ``gpu_weight``."""
    mix = dict(DEFAULT_HARDWARE_MIX if hardware_mix is None else hardware_mix)
    _check(gpus, regions, model, throttled_fraction, mix)
    rng = random.Random(f"fleet:{seed}")
    classes = list(mix)
    counts = apportion(gpus, [mix[c] for c in classes])
    hardware = [hw for hw, n in zip(classes, counts, strict=True) for _ in range(n)]
    rng.shuffle(hardware)
    throttled = set(rng.sample(range(gpus), throttled_count(gpus, throttled_fraction)))
    gpu_entries = [_gpu(hardware[i], i in throttled, model) for i in range(gpus)]
    chosen = CLOUD_REGIONS[:regions]
    per_region = apportion(gpus, region_weights(chosen, sized_to_demand), minimum=1)
    region_entries = []
    for region, count in zip(chosen, per_region, strict=True):
        own, gpu_entries = gpu_entries[:count], gpu_entries[count:]
        region_entries.append(_region(region, own, rng))
    first = chosen[0].location
    return {
        "redis_url": "redis://127.0.0.1:6379/0",
        "summary_cadence_s": 0.5,
        "health_interval_s": 0.5,
        "global": {
            "listen": ANY_PORT,
            "ops_listen": ANY_PORT,
            "location": _point(first.lat, first.lon),
        },
        "regions": region_entries,
    }


def region_weights(chosen: Sequence[CloudRegion], sized_to_demand: bool) -> list[float]:
    """What the GPUs are split by: each region's ``gpu_weight``, or its peak share of a
    day's traffic from the default cities (a region nearest none gets the minimum)."""
    if not sized_to_demand:
        return [r.gpu_weight for r in chosen]
    peaks = day_peak_shares(CITIES, {r.name: r.location for r in chosen})
    return [peaks[r.name] for r in chosen]


def _region(region: CloudRegion, gpus: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    """A region's entry: its GPUs over 2-3 zones by seeded weights, named by zone."""
    zones = min(3 if region.gpu_weight >= THREE_ZONE_WEIGHT else 2, len(gpus))
    sizes = apportion(len(gpus), [rng.uniform(0.8, 1.2) for _ in range(zones)], minimum=1)
    zone_entries = []
    for z, size in enumerate(sizes):
        own, gpus = gpus[:size], gpus[size:]
        name = region.zone_name(z)
        for k, gpu in enumerate(own):
            gpu["name"] = f"{name}-gpu{k}"
        where = region.zone_location(z)
        zone_entries.append(
            {
                "name": name,
                "location": _point(where.lat, where.lon),
                "listen": ANY_PORT,
                "ops_listen": ANY_PORT,
                "gpus": own,
            }
        )
    return {
        "name": region.name,
        "location": _point(region.location.lat, region.location.lon),
        "listen": ANY_PORT,
        "ops_listen": ANY_PORT,
        "zones": zone_entries,
    }


def _point(lat: float, lon: float) -> dict[str, float]:
    return {"lat": lat, "lon": lon}


def _gpu(hardware: str, throttled: bool, model: str) -> dict[str, Any]:
    gpu: dict[str, Any] = {
        "name": "",  # named by its zone (_region)
        "hardware": hardware,
        "models": [model],
        "max_concurrency": MAX_CONCURRENCY[hardware],
        "listen": ANY_PORT,
        "metrics_listen": ANY_PORT,
    }
    if throttled:
        gpu["throttle"] = THROTTLE
    return gpu


def describe(mapping: Mapping[str, Any]) -> str:
    """The header comment of a written fleet: what is in it, in a few lines."""
    regions = mapping["regions"]
    gpus = [g for r in regions for z in r["zones"] for g in z["gpus"]]
    counts = sorted({len(r["zones"]) for r in regions})
    zones = f"{counts[0]}-{counts[-1]} zones" if len(counts) > 1 else f"{counts[0]} zone(s)"
    per_region = ", ".join(
        f"{r['name']} {sum(len(z['gpus']) for z in r['zones'])}" for r in regions
    )
    classes = Counter(g["hardware"] for g in gpus)
    mix = ", ".join(f"{hw} {classes[hw]}" for hw in sorted(classes))
    slots = ", ".join(f"{hw} {MAX_CONCURRENCY[hw]}" for hw in sorted(classes))
    throttled = sum(1 for g in gpus if "throttle" in g)
    text = (
        f"A simulated fleet (sim.fleet_gen): {len(gpus)} GPUs in {len(regions)} regions "
        f"({per_region}), {zones} per region. Hardware: {mix}; {throttled} throttled to "
        f"{THROTTLE}. max_concurrency "
        f"per class lets that many conversation-shaped requests ({BATCH_RESERVATION_TOKENS} "
        f"KV tokens each) fit the KV cache: {slots}. Every address is 127.0.0.1:0 "
        "(`meridian up` picks free ports); no auth section (a generated file carries no keys)."
    )
    return "\n".join("# " + line for line in textwrap.wrap(text, width=86, break_on_hyphens=False))


def write_fleet(path: str | Path, mapping: Mapping[str, Any]) -> None:
    """Write ``mapping`` as topology YAML with a short header saying what it holds."""
    body = yaml.safe_dump(dict(mapping), sort_keys=False, default_flow_style=False)
    Path(path).write_text(describe(mapping) + "\n" + body, encoding="utf-8")
