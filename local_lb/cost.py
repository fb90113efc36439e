"""The local tier's cost formulas: small pure functions, one idea each.

Work is measured in *decode-token equivalents*: a generated token is 1, a
prompt token that must be prefilled is ``PREFILL_WEIGHT`` (prefill runs in
parallel over the prompt, ~20x cheaper per token than decoding one token),
and a prompt token already in the GPU's prefix cache is free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from local_lb.state import GpuChild

PREFILL_WEIGHT = 0.05
# EWMA weight of a new service-rate observation.
RATE_EWMA_ALPHA = 0.2
# A GPU nobody has heard from lately is assumed this busy (fraction of its slots),
# on top of what this tier itself has in flight there: stale is never idle.
STALE_BUSY_FRACTION = 0.5


def request_work(prompt_tokens: int, max_tokens: int, cached_tokens: int = 0) -> float:
    """Work a request puts on a GPU, crediting the prompt tokens already cached there."""
    uncached = max(0, prompt_tokens - cached_tokens)
    return max_tokens + PREFILL_WEIGHT * uncached


def outstanding_work(
    own_inflight_work: float,
    own_inflight_requests: int,
    reported_requests: float | None,
    slots: int,
) -> float:
    """Work ahead of a new request on a GPU.

    This tier's own in-flight work is known exactly. The GPU's report
    (running + waiting) also counts requests from other routers; those are
    valued at the mean size of ours. ``reported_requests`` is None when the
    report is stale or missing: then a conservative share of the slots is
    assumed busy, never zero.
    """
    mean = own_inflight_work / own_inflight_requests if own_inflight_requests else 1.0
    if reported_requests is None:
        foreign = STALE_BUSY_FRACTION * slots
    else:
        foreign = max(0.0, reported_requests - own_inflight_requests)
    return own_inflight_work + foreign * max(mean, 1.0)


def expected_completion_s(work_ahead: float, work: float, rate: float, share: float = 1.0) -> float:
    """When a request of ``work`` would finish behind ``work_ahead`` at ``rate`` work/s.

    ``share`` (0..1] is the slow-start factor: a warming GPU is treated as
    proportionally slower so it receives proportionally less.
    """
    return (work_ahead + work) / (rate * share)


def gpu_completion_s(gpu: GpuChild, work: float, work_ahead: float) -> float:
    """When a request of ``work`` would finish on ``gpu`` behind ``work_ahead``: the one
    cost the default picker ranks by and a lease reports as its ``estimated_s``.

    The operator's weight (Admin ``SetWeight``) scales the learned rate: weight 2
    looks twice as fast. The slow-start share is floored at 1e-3 so a GPU whose
    share is (near) zero costs a lot rather than dividing by zero.
    """
    return expected_completion_s(work_ahead, work, gpu.rate * gpu.weight, max(gpu.share, 1e-3))


def attempt_expected_s(gpu: GpuChild, work: float, work_ahead: float) -> float:
    """How long one attempt of ``work`` takes on ``gpu`` at its normal speed: the basis
    of its per-try timeout (``common.config.liveness.PerTryTimeout``).

    The longer of: everything ahead of it and itself drained at the GPU's learned
    rate, and itself alone at its share of a full batch (``slots`` requests sharing
    the rate). The first alone would be far too short for a long generation on a
    GPU whose rate was learned at a large batch: one request runs at one token per
    decode step, however fast the batch goes. Weight and slow start change where
    requests go, not how fast a GPU runs, so neither shortens it.
    """
    return max(work_ahead + work, work * gpu.slots) / max(gpu.rate, 1e-9)


def drain_rps(gpus: Iterable[GpuChild]) -> float:
    """Requests per second the usable ones among ``gpus`` finish: slots over latency
    (1 s until a latency has been learned)."""
    return sum(g.slots / (g.latency_ewma_s or 1.0) for g in gpus if g.usable)


def ewma(previous: float, sample: float, alpha: float = RATE_EWMA_ALPHA) -> float:
    return previous + alpha * (sample - previous)


def rate_sample(work: float, elapsed_s: float, concurrent: int) -> float | None:
    """A GPU's service rate seen by one finished request.

    Under continuous batching a request advances at the GPU's rate divided by
    the batch it shares, so the GPU's rate is its own rate times the number
    of requests that were running beside it (including itself).
    """
    if elapsed_s <= 0 or work <= 0:
        return None
    return work / elapsed_s * max(1, concurrent)
