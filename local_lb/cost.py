"""The local tier's cost formulas: small pure functions, one idea each.

Work is measured in *decode-token equivalents*: a generated token is 1, a
prompt token that must be prefilled is ``PREFILL_WEIGHT`` (prefill runs in
parallel over the prompt, ~20x cheaper per token than decoding one token),
and a prompt token already in the GPU's prefix cache is free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

# Defined with PickRequest.work (the unit of every tier's work figures), re-exported.
from common.request.pick import PREFILL_WEIGHT as PREFILL_WEIGHT

if TYPE_CHECKING:
    from local_lb.state import GpuChild

# Work (decode-token equivalents) per second of one A100 at a full batch: the seed of
# each GPU's learned rate and the unit of its hardware speed.
A100_WORK_PER_S = 2000.0
# EWMA weight of a new service-rate observation.
RATE_EWMA_ALPHA = 0.2
# A GPU nobody has heard from lately is assumed this busy (fraction of its slots),
# on top of what this tier itself has in flight there: stale is never idle.
STALE_BUSY_FRACTION = 0.5
# The most a long request's ranking raises the GPU's slowness to (long_request_weight).
MAX_LENGTH_EXTRA = 2.0


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


def sharing(own_inflight_requests: int, reported_requests: float | None, slots: int) -> float:
    """Requests a new one would share a GPU's batch with.

    This tier's own in flight are known exactly; the GPU's report (running +
    waiting) adds those of other routers. ``reported_requests`` is None when the
    report is stale or missing: then a conservative share of the slots is assumed
    busy, never zero.
    """
    if reported_requests is None:
        return own_inflight_requests + STALE_BUSY_FRACTION * slots
    return max(float(own_inflight_requests), reported_requests)


def gpu_completion_s(gpu: GpuChild, work: float, shared_with: float) -> float:
    """When a request of ``work`` would finish on ``gpu`` beside ``shared_with`` others:
    the one cost the default picker ranks by and a lease reports as its ``estimated_s``.

    Under continuous batching a request does not wait for the work ahead of it: it
    runs beside it, and what slows it is how many sequences share the GPU's steps
    (processor sharing): ``work × (shared_with + 1) / rate``. The rate is the GPU's
    hardware speed (class × throttle) in A100 work per second, times the operator's
    weight (Admin ``SetWeight``) and the slow-start share (floored at 1e-3, so a
    warming GPU costs a lot rather than dividing by zero). Not the learned rate: that
    is throughput at the batch a GPU happened to run, so ranking by it sent more to
    whichever GPU already held the biggest batch (the fleet simulator's finding,
    README "The fleet simulator"); a GPU that runs slower than its class holds its
    requests longer, and the count it is ranked by grows.
    """
    rate = gpu.speed * A100_WORK_PER_S * gpu.weight * max(gpu.share, 1e-3)
    return work * (shared_with + 1.0) / rate


def long_request_weight(
    gpu: GpuChild, work: float, typical_work: float, length_bias: float
) -> float:
    """What a request longer than the typical one pays on ``gpu`` beyond its expected
    completion, in the default picker's ranking: ``(1 / speed) ** extra``, where
    ``extra = (work / typical_work) ** length_bias - 1``, at most ``MAX_LENGTH_EXTRA``.
    1 for a request no longer than typical, for an A100-speed GPU, or with
    ``length_bias`` 0.

    Why: ranked by its own completion time alone, a request's choice between a fast
    and a slow GPU does not depend on its length (both times scale with its work), so
    long generations landed on slow GPUs as often as short ones, and they are the tail:
    in the simulator of one mixed zone at 85 % load, the slowest 2 % of requests were
    long ones on the V100s and the throttled A100, ~9 s against ~3.6 s for the same
    lengths on the H200 (on the real zone nginx's weighted ``least_conn`` had the lower
    P99: ``bench.zone_peers``). A
    long request now prefers a fast GPU more strongly, and short ones fill the slower
    GPUs instead, where their few tokens cost little."""
    if length_bias <= 0 or typical_work <= 0 or work <= typical_work:
        return 1.0
    extra = min(MAX_LENGTH_EXTRA, (work / typical_work) ** length_bias - 1.0)
    return (gpu.speed * gpu.weight * max(gpu.share, 1e-3)) ** -extra


def capacity_work_per_s(gpu: GpuChild) -> float:
    """What ``gpu`` can do in a second, the unit of a zone's wait: its learned rate or
    its hardware speed (class × throttle × the operator's weight, in A100 work per
    second), whichever is more. The learned rate alone is throughput at whatever batch
    the GPU happened to run, so a quiet zone looked slow and kept its clients away
    (the fleet simulator); the hardware figure alone is a model's constant, wrong for a
    GPU faster than it (an emulated GPU at a time scale, a newer class)."""
    return max(gpu.rate, gpu.speed * A100_WORK_PER_S * gpu.weight)


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
    # Every GPU of a zone, for every request that queues and every summary: the sum
    # and GpuChild.usable written out (the property call was half the time).
    total = 0.0  # a float from the start: mypyc (sim.native) keeps the type declared
    for g in gpus:
        if g.healthy and not g.ejected and not g.drained:
            total += g.slots / (g.latency_ewma_s or 1.0)
    return total


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
