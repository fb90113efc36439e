"""Which Redis holds what (``common.config.redis_layout``), ``regions[].redis_url``
validation, and the hash tags that keep keys used together in one Cluster slot."""

from __future__ import annotations

import copy
import uuid
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import region_stream, zone_stream
from common.config.access import TenantConfig
from common.config.node import ConfigError
from common.config.redis_layout import RedisKeys, redis_url_for
from common.config.topology import topology_from_mapping
from common.tenancy.quota import TenantRateLimiter
from common.tenancy.usage_record import USAGE_STREAM, batch_key, meta_key
from sim.topology import one_zone_mapping

GLOBAL = "redis://global.internal:6379/0"
EU = "redis+sentinel://s1:26379,s2:26379/eu/0"


def two_regions(eu_url: Any = EU) -> dict[str, Any]:
    mapping = one_zone_mapping(GLOBAL, region="eu", zone="eu-1a")
    us = copy.deepcopy(mapping["regions"][0])
    us.update(name="us", listen="127.0.0.1:3")
    us["zones"][0]["name"] = "us-1a"
    for gpu in us["zones"][0]["gpus"]:
        gpu["name"] = f"us-{gpu['name']}"
    mapping["regions"][0]["redis_url"] = eu_url
    mapping["regions"].append(us)
    return mapping


def test_zone_summaries_live_on_their_regions_redis_the_rest_on_the_global_one() -> None:
    topo = topology_from_mapping(two_regions())
    assert topo.region("eu").redis_url == EU
    assert topo.region("us").redis_url is None
    assert redis_url_for(topo, RedisKeys.ZONE_SUMMARIES, "eu") == EU
    assert redis_url_for(topo, RedisKeys.ZONE_SUMMARIES, "us") == GLOBAL  # none of its own
    assert redis_url_for(topo, RedisKeys.REGION_SUMMARIES) == GLOBAL
    assert redis_url_for(topo, RedisKeys.TENANTS) == GLOBAL


def test_zone_summaries_need_a_region() -> None:
    topo = topology_from_mapping(two_regions())
    with pytest.raises(ValueError, match="zone summaries live on their region's Redis"):
        redis_url_for(topo, RedisKeys.ZONE_SUMMARIES)


def test_a_bad_region_redis_url_fails_at_start_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(two_regions("redis+sentinel://s1:26379"))
    assert str(err.value) == (
        "regions[0].redis_url: redis+sentinel URL must end in /service_name or "
        "/service_name/db: 'redis+sentinel://s1:26379'"
    )


def test_a_region_redis_url_must_be_text() -> None:
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(two_regions(6379))
    assert str(err.value) == "regions[0].redis_url: expected str, got 6379"


def test_a_bad_top_level_redis_url_fails_at_start_naming_the_key() -> None:
    mapping = two_regions()
    mapping["redis_url"] = "redis://:pw@h:1/zero"
    with pytest.raises(ConfigError) as err:
        topology_from_mapping(mapping)
    assert str(err.value) == (
        "redis_url: Redis URL path must be a database number, got 'zero' in 'redis://:***@h:1/zero'"
    )


def test_a_regions_zone_streams_share_one_cluster_slot() -> None:
    """A regional tier follows all its zones in one XREAD (one slot on a Cluster)."""
    slots = {key_slot(zone_stream("eu-west", z).encode()) for z in ("a", "b", "c")}
    assert len(slots) == 1


def test_every_region_stream_shares_one_cluster_slot() -> None:
    """The global tier follows every region in one XREAD."""
    assert len({key_slot(region_stream(r).encode()) for r in ("eu", "us", "ap")}) == 1


def test_a_usage_batch_its_marker_and_the_meta_hash_share_one_cluster_slot() -> None:
    """One Lua script writes all three."""
    keys = [USAGE_STREAM, meta_key(USAGE_STREAM), batch_key(USAGE_STREAM, "b1")]
    assert len({key_slot(k.encode()) for k in keys}) == 1
    plain = "billing-usage"  # a stream named without a tag gets its whole name as the tag
    keys = [plain, meta_key(plain), batch_key(plain, "b1")]
    assert len({key_slot(k.encode()) for k in keys}) == 1


async def test_a_tenants_quota_keys_share_one_cluster_slot(redis_server: EmbeddedRedis) -> None:
    """The GCRA script updates a tenant's rps and tpm keys together: read them back from
    a real Redis after one admission."""
    who = TenantConfig(
        id=f"slots-{uuid.uuid4().hex[:8]}",
        key_hashes=frozenset(),
        requests_per_s=5.0,
        tokens_per_min=600_000.0,
    )
    limiter = TenantRateLimiter(redis_server.url, redis_timeout_s=1.0)
    try:
        await limiter.admit(who, 1000)
    finally:
        await limiter.close()
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys = list(client.scan_iter(match=f"meridian:quota:*{who.id}*"))
    finally:
        client.close()
    assert len(keys) == 2 and len({key_slot(k) for k in keys}) == 1, keys
