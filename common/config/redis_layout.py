"""Which Redis holds which keys: the one place that decides it.

A topology names one global Redis (top-level ``redis_url``) and, optionally,
one per region (``regions[].redis_url``; absent: the global one). Keys live
where the tiers that share them run:

=======================================================  ===========  ==================
keys                                                      Redis        written / read by
=======================================================  ===========  ==================
``meridian:capacity:zone:{<region>}:<zone>``              the region's local / regional
``meridian:capacity:region:{regions}:<region>``           global       regional / global
``meridian:quota:{<tenant>}:rps|tpm``                     global       the edge
``meridian:concurrency:{<tenant>}:leases``                global       the edge
``meridian:{usage}``, ``…:meta``, ``…:batch:<id>``        global       edge / ``usage``
=======================================================  ===========  ==================

So a region's Redis carries only traffic of that region (its zones' summaries
at the cadence), a region whose Redis is down keeps routing on health while
the others are unaffected, and tenant quotas and billing stay in the one Redis
every edge shares. The ``{…}`` parts are Redis Cluster hash tags: keys one
script or one XREAD touches together share a slot (a region's zone streams;
all region streams; one tenant's quota keys; the usage stream, its meta hash
and its batch markers), so the layout is ready for a Redis Cluster (Meridian
has no Cluster client yet: a URL names one server or one Sentinel service).
"""

from __future__ import annotations

import enum

from common.config.topology import Topology


class RedisKeys(enum.Enum):
    """The groups of keys in the table above."""

    ZONE_SUMMARIES = "zone summary streams"
    REGION_SUMMARIES = "region summary streams"
    TENANTS = "tenant quotas, concurrency leases and usage records"


def redis_url_for(topology: Topology, keys: RedisKeys, region: str | None = None) -> str:
    """The URL of the Redis that holds ``keys`` (zone summaries: of ``region``)."""
    if keys is RedisKeys.ZONE_SUMMARIES:
        if region is None:
            raise ValueError("zone summaries live on their region's Redis: name the region")
        return topology.region(region).redis_url or topology.redis_url
    return topology.redis_url

