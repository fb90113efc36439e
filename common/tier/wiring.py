"""What the three tiers wire alike, built from the topology in one place."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from common.capacity.streams import CapacityPublisher, CapacityReader
from common.config.redis_layout import RedisKeys, redis_url_for
from common.config.tls import TierTls, tier_channel_credentials
from common.config.topology import Topology
from common.gen.meridian.v1 import capacity_pb2
from common.request.children import Child, ChildSet


def tier_children(
    topology: Topology,
    children: Iterable[Child],
    kind: str,
    *,
    tls: TierTls | None = None,
    probe: bool = True,
) -> ChildSet:
    """A tier's children with the topology's health interval, summary TTL and keepalive;
    tier children (``probe``) are dialled presenting this instance's certificate
    (``tls``; None: plaintext), GPU workers as each one's entry says
    (``Child.credentials``), with the GPU keepalive, and health-checked by the local
    tier's own monitor."""
    liveness = topology.liveness
    return ChildSet(
        tuple(children),
        probe_interval_s=topology.health_interval_s,
        summary_ttl_s=topology.summary_ttl_s,
        kind=kind,
        credentials=tier_channel_credentials(tls) if probe else None,
        keepalive=liveness.keepalive if probe else liveness.gpu_keepalive,
        probe=probe,
        # Tier children are dialled by name, over all their replicas; GPUs one by one.
        dns=topology.dns if probe else None,
    )


def summary_reader(
    topology: Topology,
    streams: Mapping[str, str],
    children: ChildSet,
    keys: RedisKeys,
    region: str | None = None,
) -> CapacityReader:
    """Follows the children's summary streams (stream name -> child name), on the
    Redis that holds ``keys`` (zone summaries: ``region``'s; ``redis_layout``)."""
    url = redis_url_for(topology, keys, region)
    return CapacityReader(url, streams, children.take_summary)


def summary_publisher(
    topology: Topology,
    stream: str,
    build: Callable[[int], capacity_pb2.CapacitySummary],
    keys: RedisKeys,
    region: str | None = None,
) -> CapacityPublisher:
    """Publishes this tier's summary on the topology's cadence, bounded as it says, to
    the Redis that holds ``keys`` (zone summaries: ``region``'s; ``redis_layout``)."""
    return CapacityPublisher(
        redis_url_for(topology, keys, region),
        stream,
        build,
        cadence_s=topology.summary_cadence_s,
        maxlen=topology.summary_stream_maxlen,
    )
