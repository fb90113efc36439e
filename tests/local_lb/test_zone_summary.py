"""zone_summary: a zone's capacity per model, from the tier's view of its GPUs."""

from __future__ import annotations

import asyncio

from local_lb.load_book import LoadSample
from local_lb.queue import CentralQueue
from local_lb.state import LocalView
from local_lb.zone_summary import zone_summary
from tests.local_lb.parts import M, gpus

OTHER = "other"


def _view() -> LocalView:
    a, b, c, d = gpus(4, slots=4, models=frozenset({M, OTHER}))
    # Hardware speeds giving 100, 250, 400 and 800 work/s of capacity; the learned rates
    # (throughput at whatever batch ran) are not the zone's capacity.
    a.speed, b.speed, c.speed, d.speed = 0.05, 0.125, 0.2, 0.4
    a.rate, b.rate, c.rate, d.rate = 1.0, 2.0, 3.0, 4.0
    a.outstanding_requests, b.outstanding_requests, c.outstanding_requests = 3, 6, 1
    a.latency_ewma_s, b.latency_ewma_s = 2.0, 0.5
    d.healthy = False  # counted among the GPUs, not in the capacity
    c.models = frozenset({M})
    view = LocalView((a, b, c, d))
    view.load.update("g0", LoadSample(2, 5, 0.5, 99.0, "metrics"))
    view.load.update("g1", LoadSample(4, 1, None, 99.5, "trailer"))
    view.load.update("g2", LoadSample(1, 7, 0.25, 90.0, "metrics"))  # stale: unknown
    view.load.update("g3", LoadSample(0, 9, 0.9, 100.0, "metrics"))  # down: not counted
    return view


async def _summary() -> list[tuple[object, ...]]:
    view = _view()
    queue = CentralQueue(release=lambda gpu: None, clock=lambda: 100.0)
    for _ in range(2):
        queue.enqueue(model=M, tenant="t", priority="standard", cost_tokens=10.0)
    summary = zone_summary(
        view, queue, source="local:z", sequence=3, region="r", zone="z", now=100.0
    )
    assert (summary.source_id, summary.sequence, summary.region, summary.zone) == (
        "local:z",
        3,
        "r",
        "z",
    )
    assert summary.publisher_healthy
    return [
        (
            e.model,
            e.total_gpus,
            e.healthy_gpus,
            e.total_slots,
            e.busy_slots,
            e.free_slots,
            e.queued_requests,
            e.tier_queued_requests,
            e.token_throughput_capacity,
            round(e.utilisation, 9),
            round(e.kv_cache_usage, 9),
            round(e.estimated_wait_s, 9),
        )
        for e in summary.models
    ]


def test_sums_usable_gpus_fresh_reports_and_the_tier_queue_per_model() -> None:
    entries = asyncio.run(_summary())
    # M: g0, g1, g2 usable (12 slots), busy min(3,4) + min(6,4) + 1 = 8; reported waiting
    # 5 + 1 from the fresh samples (g2's is stale) plus 2 in the tier's queue; KV 0.5 x 4
    # slots over 12; drain = 4/2 + 4/0.5 + 4/1 = 14 rps for 8 queued.
    m = (M, 4, 3, 12, 8, 4, 8, 2, 750.0, round(8 / 12, 9), round(2 / 12, 9), round(8 / 14, 9))
    # OTHER: g0, g1 usable (8 slots), busy 7, waiting 6, drain 2 + 8 = 10 rps.
    other = (OTHER, 3, 2, 8, 7, 1, 6, 0, 350.0, round(7 / 8, 9), round(2 / 8, 9), 0.6)
    assert entries == [m, other]


def _one_model_summary() -> list[tuple[object, ...]]:
    view = _view()
    for gpu in view.gpus:
        gpu.models = frozenset({M})
    view.set_gpus(view.gpus)

    async def summarise() -> list[tuple[object, ...]]:
        queue = CentralQueue(release=lambda gpu: None, clock=lambda: 100.0)
        queue.enqueue(model=M, tenant="t", priority="standard", cost_tokens=10.0)
        summary = zone_summary(
            view, queue, source="local:z", sequence=4, region="r", zone="z", now=100.0
        )
        return [
            (
                e.model,
                e.total_gpus,
                e.healthy_gpus,
                e.total_slots,
                e.busy_slots,
                e.free_slots,
                e.queued_requests,
                e.tier_queued_requests,
                e.token_throughput_capacity,
                round(e.utilisation, 9),
                round(e.kv_cache_usage, 9),
                round(e.estimated_wait_s, 9),
            )
            for e in summary.models
        ]

    return asyncio.run(summarise())


def test_a_zone_of_one_model_sums_the_same_way() -> None:
    # As M above, with one request in the tier's queue: 5 + 1 reported + 1 queued = 7
    # over the same 14 rps; the down GPU still counts among the GPUs.
    assert _one_model_summary() == [
        (M, 4, 3, 12, 8, 4, 7, 1, 750.0, round(8 / 12, 9), round(2 / 12, 9), round(7 / 14, 9))
    ]
