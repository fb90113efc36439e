"""``meridian up``: a region of the fleet file may ask for an embedded Redis of its own.

A region entry with ``redis_url: embedded`` gets its own embedded Redis (a second
redis-server, append-only file in ``<run_dir>/redis-<region>``), and its URL is
written into the topology the tiers read, so the fleet on one machine has the
layout of one spread over several (``common.config.redis_layout``): that region's
zone streams on its Redis, everything else on the fleet's. Only the launcher
knows the word; a topology given to ``meridian global|regional|local`` names URLs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.basics.redis_embed import EmbeddedRedis

EMBEDDED = "embedded"


def embed_region_redises(
    raw: dict[str, Any], run_dir: Path, acl_file: Path | None = None
) -> dict[str, EmbeddedRedis]:
    """An (unstarted) embedded Redis per region of ``raw`` that asks for one, by region
    name, with the fleet's ACL users (``acl_file``; None: none); each region's
    ``redis_url`` in ``raw`` is replaced by its server's URL (without credentials)."""
    servers: dict[str, EmbeddedRedis] = {}
    for region in raw.get("regions") or ():
        if isinstance(region, dict) and region.get("redis_url") == EMBEDDED:
            name = str(region.get("name"))
            servers[name] = EmbeddedRedis(data_dir=run_dir / f"redis-{name}", acl_file=acl_file)
            region["redis_url"] = servers[name].address_url
    return servers
