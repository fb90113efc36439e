"""One-zone topologies for tests and benchmarks that run a tier in-process.

Every listen address is a free loopback port except where the caller names
one (an in-process local tier never listens on the global or regional
address it is given).
"""

from __future__ import annotations

from typing import Any

from common.basics.redis_embed import free_port


def one_zone_mapping(
    redis_url: str,
    *,
    gpus: int = 2,
    model: str = "m",
    max_concurrency: int = 16,
    region: str = "r",
    zone: str = "r-1a",
    global_listen: str = "127.0.0.1:1",
    region_listen: str = "127.0.0.1:2",
    global_location: tuple[float, float] = (0.0, 0.0),
    region_location: tuple[float, float] = (0.0, 0.0),
    **settings: Any,
) -> dict[str, Any]:
    """A topology mapping (for ``topology_from_mapping``) with one region, one zone and
    ``gpus`` A100s serving ``model``; ``settings`` adds top-level keys."""
    return {
        "redis_url": redis_url,
        **settings,
        "global": {
            "listen": global_listen,
            "location": {"lat": global_location[0], "lon": global_location[1]},
        },
        "regions": [
            {
                "name": region,
                "location": {"lat": region_location[0], "lon": region_location[1]},
                "listen": region_listen,
                "zones": [
                    {
                        "name": zone,
                        "listen": f"127.0.0.1:{free_port()}",
                        "gpus": [
                            {
                                "name": f"g{i}",
                                "hardware": "A100",
                                "models": [model],
                                "max_concurrency": max_concurrency,
                                "listen": f"127.0.0.1:{free_port()}",
                                "metrics_listen": f"127.0.0.1:{free_port()}",
                            }
                            for i in range(gpus)
                        ],
                    }
                ],
            }
        ],
    }
