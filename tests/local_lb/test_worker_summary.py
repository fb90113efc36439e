"""The zone summaries of a local tier's workers (each holding a share of every GPU's
slots) combine, as replicas, to the zone's whole capacity."""

from __future__ import annotations

import asyncio

from common.capacity.summary import combine_replicas
from common.gen.meridian.v1 import capacity_pb2
from local_lb.queue import CentralQueue
from local_lb.state import GpuChild, LocalView
from local_lb.zone_summary import zone_summary
from tests.local_lb.parts import M, gpus

OTHER = "other"


def worker_view(inflight: list[int], *, models: frozenset[str] = frozenset({M})) -> LocalView:
    """A worker's view of 2 GPUs of 4 slots, of which it holds 2 each."""
    held: list[GpuChild] = gpus(2, slots=2, models=models)
    for gpu, n in zip(held, inflight, strict=True):
        gpu.gpu_slots, gpu.outstanding_requests = 4, n
    return LocalView(tuple(held))


def summary_of(view: LocalView, source: str) -> capacity_pb2.CapacitySummary:
    async def build() -> capacity_pb2.CapacitySummary:
        queue = CentralQueue(release=lambda gpu: None, clock=lambda: 100.0)
        return zone_summary(view, queue, source=source, sequence=1, region="r", zone="z", now=100.0)

    return asyncio.run(build())


def test_each_worker_counts_the_gpus_whole_and_its_own_requests_busy() -> None:
    (entry,) = summary_of(worker_view([2, 1]), "local/r/z/a").models
    assert (entry.total_slots, entry.busy_slots, entry.free_slots) == (8, 3, 5)


def test_two_workers_combine_to_the_zones_slots_and_all_their_busy_ones() -> None:
    a = summary_of(worker_view([2, 1]), "local/r/z/a")
    b = summary_of(worker_view([1, 2]), "local/r/z/b")
    (entry,) = combine_replicas([a, b]).models
    assert (entry.total_slots, entry.busy_slots, entry.free_slots) == (8, 6, 2)
    assert entry.utilisation == 6 / 8


def test_a_zone_of_several_models_counts_the_same_way() -> None:
    views = [worker_view([2, 0], models=frozenset({M, OTHER})) for _ in range(2)]
    views[0].gpus[1].models = frozenset({M})  # per-model path
    views[0].set_gpus(views[0].gpus)
    a, b = (summary_of(v, f"local/r/z/{i}") for i, v in enumerate(views))
    by_model = {e.model: e for e in combine_replicas([a, b]).models}
    assert (by_model[M].total_slots, by_model[M].busy_slots) == (8, 4)
    assert (by_model[OTHER].total_slots, by_model[OTHER].busy_slots) == (8, 4)


def test_a_gpu_not_split_reports_its_slots_as_before() -> None:
    (gpu,) = gpus(1, slots=4)
    gpu.outstanding_requests = 3
    (entry,) = summary_of(LocalView((gpu,)), "local/r/z/a").models
    assert (gpu.whole_slots, entry.total_slots, entry.busy_slots) == (4, 4, 3)
