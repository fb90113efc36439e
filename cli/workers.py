"""What the workers of one tier process share, and what each holds alone (``--workers N``).

``meridian global|regional|local ... --workers N`` runs N processes of the same tier
(``cli.supervisor`` starts and watches them). Each one is a whole tier: its own event
loop, children, channels, picker state and Redis clients. ``worker_topology`` rewrites
the topology as worker ``index`` sees it:

* **the tier's data-plane ports are shared** (SO_REUSEPORT: the kernel spreads new
  connections over the workers): the V2 gRPC port, the tier's OpenAI HTTP (any tier's
  ``openai_listen``) and the local tier's ext_proc port. They must be fixed ports (0
  would give each worker a port of its own): a ConfigError naming the key otherwise.
* **ops HTTP is per worker**: worker ``i`` serves its ops on the configured port + ``i``
  (port 0: each picks a free one), so each scrape of ``/metrics`` is one process's
  counters, whole; a shared port would hand each scrape to a random worker and the
  counters would jump between them. Scrape all N.
* **the local tier's GPU slots are split**: worker ``i`` holds
  ``max_concurrency // N`` slots of every GPU, the remainder one each to the first
  workers (``common.config.gpu.split_slots``), so together they never run more on a
  GPU than its ``max_concurrency``; a GPU with fewer slots than workers is a
  ConfigError. Each worker's picker still reads the GPU's own load reports (running
  and waiting, from its metrics), which count every worker's requests. Each worker
  queues centrally on its own share: a request can wait in one worker while another
  has a free slot on the same GPU (the price of not sharing state between processes).
* **summaries**: each local worker publishes the zone's summary as a replica (its own
  source id), every GPU's slots whole and only its own requests busy, and the regional
  tier's ``combine_replicas`` takes the slots once and adds the busy ones up. Only
  regional worker 0 publishes the region's summary: the others' would be the same
  aggregate (the global tier takes the newest of a region's replicas, never a sum),
  N times the Redis traffic for nothing.
* **the edge's tenant quotas and concurrency caps are already shared through Redis**;
  with Redis down each global worker (or worker of an inner tier's OpenAI edge) falls
  back to its 1/N share.

Not shared: the Admin API. It is served on the shared gRPC port, so a drain, weight or
reload would reach the one worker the connection landed on: each worker refuses those it
would apply itself (FAILED_PRECONDITION, ``common.operations.admin``); change the
topology file and restart the tier, or run one worker.

SO_REUSEPORT spreads connections, not calls: one parent process holds one connection to
a child and so reaches one of its workers. The spread comes from many clients (the edge)
or from a parent that runs several workers or replicas itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config.gpu import split_slots
from common.config.node import ConfigError, Endpoint
from common.config.openai_edge import OpenAIEdgeConfig
from common.config.topology import Topology, ZoneConfig


@dataclass(frozen=True)
class WorkerPlace:
    """Which worker of how many this process is (``--workers``; 0 of 1: the only one)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"--workers: must be a whole number > 0, not {self.count}")
        if not 0 <= self.index < self.count:
            raise ConfigError(f"--worker-index: {self.index} is not in 0..{self.count - 1}")

    @property
    def shared(self) -> bool:
        return self.count > 1


def _shared(endpoint: Endpoint, key: str) -> Endpoint:
    if endpoint.port == 0:
        raise ConfigError(
            f"{key}: port 0 picks a port per process; --workers above 1 needs a fixed port "
            "the workers share"
        )
    return dataclasses.replace(endpoint, reuse_port=True)


def _shared_openai(openai: OpenAIEdgeConfig | None, key: str) -> OpenAIEdgeConfig | None:
    if openai is None:
        return None
    return dataclasses.replace(openai, endpoint=_shared(openai.endpoint, key))


def _own_ops(ops: Endpoint | None, place: WorkerPlace) -> Endpoint | None:
    if ops is None or ops.port == 0:
        return ops
    return dataclasses.replace(ops, port=ops.port + place.index)


def worker_topology(
    topology: Topology, command: str, place: WorkerPlace, region: str = "", zone: str = ""
) -> Topology:
    """``topology`` as worker ``place`` of the ``command`` tier (global, regional or
    local) binds it; unchanged for the only worker."""
    if not place.shared:
        return topology
    if command == "global":
        g = topology.global_tier
        tier = dataclasses.replace(
            g,
            endpoint=_shared(g.endpoint, "global.listen"),
            ops=_own_ops(g.ops, place),
            openai=_shared_openai(g.openai, "global.openai.listen"),
        )
        return dataclasses.replace(topology, global_tier=tier)
    regions = []
    for i, r in enumerate(topology.regions):
        if r.name == region and command == "regional":
            r = dataclasses.replace(
                r,
                endpoint=_shared(r.endpoint, f"regions[{i}].listen"),
                ops=_own_ops(r.ops, place),
                openai=_shared_openai(r.openai, f"regions[{i}].openai_listen"),
            )
        elif r.name == region:
            zones = tuple(
                _local_worker(z, place, f"regions[{i}].zones[{j}]") if z.name == zone else z
                for j, z in enumerate(r.zones)
            )
            r = dataclasses.replace(r, zones=zones)
        regions.append(r)
    return dataclasses.replace(topology, regions=tuple(regions))


def _local_worker(z: ZoneConfig, place: WorkerPlace, key: str) -> ZoneConfig:
    ext_proc = z.ext_proc
    if ext_proc is not None:
        ext_proc = dataclasses.replace(
            ext_proc, listen=_shared(ext_proc.listen, f"{key}.ext_proc.listen")
        )
    gpus = tuple(
        split_slots(g, place.count, place.index, f"{key}.gpus[{k}].max_concurrency")
        for k, g in enumerate(z.gpus)
    )
    return dataclasses.replace(
        z,
        endpoint=_shared(z.endpoint, f"{key}.listen"),
        ops=_own_ops(z.ops, place),
        ext_proc=ext_proc,
        gpus=gpus,
        openai=_shared_openai(z.openai, f"{key}.openai_listen"),
    )


def worker_addresses(
    topology: Topology, command: str, count: int, region: str = "", zone: str = ""
) -> list[Endpoint]:
    """Every fixed address the ``count`` workers of the ``command`` tier bind: the shared
    data-plane ports and each worker's own ops port (the supervisor checks all are free
    before it starts a worker, since SO_REUSEPORT would share a port with a stray
    process of the same user instead of failing). Raises ConfigError as
    ``worker_topology`` does."""
    first = worker_topology(topology, command, WorkerPlace(0, count), region, zone)
    if command == "global":
        g = first.global_tier
        shared = [g.endpoint, *([g.openai.endpoint] if g.openai else [])]
        base = topology.global_tier.ops
    elif command == "regional":
        r = first.region(region)
        shared = [r.endpoint, *([r.openai.endpoint] if r.openai else [])]
        base = topology.region(region).ops
    else:
        z = first.zone(region, zone)
        shared = [z.endpoint, *([z.ext_proc.listen] if z.ext_proc else [])]
        shared += [z.openai.endpoint] if z.openai else []
        base = topology.zone(region, zone).ops
        for index in range(1, count):  # every worker's slot split is valid
            worker_topology(topology, command, WorkerPlace(index, count), region, zone)
    own = [_own_ops(base, WorkerPlace(i, count)) for i in range(count)]
    return shared + [ops for ops in own if ops is not None and ops.port != 0]
