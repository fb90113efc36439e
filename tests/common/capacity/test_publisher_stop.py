"""A capacity publisher stops when told to, even when poked at the same moment."""

from __future__ import annotations

import asyncio
import uuid

from common.basics.redis_embed import EmbeddedRedis
from common.capacity.streams import CapacityPublisher
from common.gen.meridian.v1 import capacity_pb2


async def test_a_poke_at_the_moment_of_stopping_does_not_swallow_the_stop(
    redis_server: EmbeddedRedis,
) -> None:
    """Python 3.11's asyncio.wait_for returns the inner result when the cancellation and
    the poke land in one loop iteration, so the publishing loop went on and stop() hung
    (a tier's teardown with it)."""
    publisher = CapacityPublisher(
        redis_server.url,
        f"test:{uuid.uuid4().hex}",
        lambda seq: capacity_pb2.CapacitySummary(source_id="s", sequence=seq),
        cadence_s=100.0,
        maxlen=10,
    )
    publisher.start()
    task = publisher._task
    assert task is not None
    try:
        await asyncio.sleep(0.3)  # published once; now waiting for a poke or the cadence
        publisher.poke()
        task.cancel()
        await asyncio.wait([task], timeout=2.0)
        assert task.cancelled()
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=2.0)
        await publisher.redis.aclose()
