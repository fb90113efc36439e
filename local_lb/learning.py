"""Rate learning: what finished requests teach about the GPUs and the zone."""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.request.balancer import Lease, Outcome
from local_lb.cost import ewma, rate_sample
from local_lb.state import GpuChild


def served_work(lease: Lease, outcome: Outcome) -> float:
    """The work an OK attempt really did: its planned work with the planned output
    replaced by the length its GPU reported (the plan itself when none was reported).
    A GPU's rate is learned from this, so answers shorter or longer than planned
    teach its true speed rather than the plan's error."""
    reported = outcome.completion_tokens
    if reported is None:
        return lease.work
    return max(0.0, lease.work + reported - lease.planned_output)


@dataclass
class RateLearner:
    """EWMAs of service rate and latency per GPU, and of work and service time per zone.

    Algorithm: each OK request yields a rate sample (its work per second times the
    batch it shared, ``cost.rate_sample``) folded into the GPU's ``rate``, and its
    elapsed time folded into the GPU's ``latency_ewma_s`` and the zone's
    ``service_s``; every arriving request's work is folded into ``work_ewma``. The
    first sample of a zero-valued EWMA seeds it.

    Caches only those EWMAs. Failure mode: until a request has finished the zone's
    service time is unknown (0), so ``expected_service_s`` is 0 and the capacity is
    infinite — nothing is shed for lateness and no tenant counts as heavy yet.
    """

    # Typical work tokens per request here: with service_s, the zone's capacity.
    work_ewma: float = 0.0
    # Typical time a request takes on a GPU here (OK requests only).
    service_s: float = 0.0

    def arrived(self, work: float) -> None:
        self.work_ewma = ewma(self.work_ewma, work) if self.work_ewma else work

    def finished_ok(self, gpu: GpuChild, work: float, elapsed_s: float, concurrent: int) -> None:
        sample = rate_sample(work, elapsed_s, concurrent)
        if sample is not None:
            gpu.rate = ewma(gpu.rate, sample)
        gpu.latency_ewma_s = (
            ewma(gpu.latency_ewma_s, elapsed_s) if gpu.latency_ewma_s else elapsed_s
        )
        self.service_s = ewma(self.service_s, elapsed_s) if self.service_s else elapsed_s

    def expected_service_s(self, work: float) -> float:
        """How long a request of ``work`` tokens typically takes on a GPU here: the
        zone's typical service time scaled by its size (0 until one has finished)."""
        if not self.service_s or not self.work_ewma:
            return 0.0
        return self.service_s * work / self.work_ewma

    def capacity_work_per_s(self, usable_slots: int) -> float:
        """Work tokens per second the zone finishes with every usable slot busy;
        infinite while unknown (nothing finished yet)."""
        return usable_slots * self.work_ewma / self.service_s if self.service_s else math.inf
