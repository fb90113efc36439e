"""The Kubernetes Gateway API Inference Extension's endpoint picker, as a local-tier baseline.

Re-implemented from the project's scorer definitions and its default
configuration (no code of it used). The endpoint picker (EPP) scores every
candidate with weighted scorers and takes the highest total; its default
profile is

    total = 2 * queue + 2 * kv_cache + 3 * prefix

- queue: ``(max_waiting - waiting) / (max_waiting - min_waiting)`` over the
  candidates, 1.0 for all when every candidate waits the same;
- kv_cache: ``1 - kv_cache_usage`` (0..1);
- prefix: matched blocks / the prompt's blocks, the match being how many of
  the prompt's leading blocks the EPP believes the pod holds (its indexer
  remembers where it sent each block);

and the max-score picker breaks ties at random (shuffle, then stable sort).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from common.request.children import Child
from common.request.pick import PickRequest
from local_lb.baselines import FALLBACKS
from local_lb.state import FreePool, GpuChild, LocalView

QUEUE_WEIGHT = 2.0
KV_CACHE_WEIGHT = 2.0
PREFIX_WEIGHT = 3.0


def queue_scores(waiting: Sequence[float]) -> list[float]:
    """The queue scorer: min-max normalised, shortest queue 1.0, longest 0.0."""
    low, high = min(waiting), max(waiting)
    if high == low:
        return [1.0] * len(waiting)
    span = high - low
    return [(high - w) / span for w in waiting]


@dataclass
class InferenceGatewayPicker:
    """The inference gateway's default scoring (see the module docstring).

    Inputs, as the EPP reads them from its metrics scrapes: each GPU's own
    report in ``view.load`` (waiting requests, KV-cache usage), taken while at
    most ``view.report_max_age_s`` old. A missing or stale report is read
    conservatively, never as idle: waiting = this tier's own in-flight requests
    on the GPU (an upper bound of what can be queued there from here), KV usage
    = 1.0 (full, score 0). A fresh report is taken as it is, without adding what
    was sent since: the EPP does not either, which is how it herds onto the GPU
    that looked emptiest at the last scrape. The prefix match is the view's
    ``PrefixIndex`` (blocks recently routed to each GPU), standing in for the
    EPP's own indexer. O(pool) per pick, as the EPP scores every candidate.
    """

    view: LocalView
    rng: random.Random
    match_limit: int = 16

    def prefix_scores(self, request: PickRequest) -> dict[str, float]:
        """Each believed holder's fraction of the prompt's blocks (others score 0)."""
        blocks = request.prefix_blocks
        if not blocks:
            return {}
        matches = self.view.prefix.matches(blocks, limit=self.match_limit)
        return {name: depth / len(blocks) for name, depth in matches.items()}

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        pool = children if isinstance(children, FreePool) else FreePool.of(children)
        if not pool:
            return []
        get, max_age = self.view.load.get, self.view.report_max_age_s
        waiting: list[float] = []
        kv_free: list[float] = []
        for gpu in pool:  # this loop is the picker's cost: kept flat
            sample = get(gpu.name, now, max_age)
            if sample is None:
                waiting.append(float(gpu.outstanding_requests))
                kv_free.append(0.0)
            else:
                waiting.append(sample.waiting)
                kv = sample.kv_cache_usage
                kv_free.append(0.0 if kv is None else 1.0 - kv)
        prefix = self.prefix_scores(request)
        scored = [
            (
                QUEUE_WEIGHT * q + KV_CACHE_WEIGHT * k + PREFIX_WEIGHT * prefix.get(gpu.name, 0.0),
                gpu,
            )
            for gpu, q, k in zip(pool, queue_scores(waiting), kv_free, strict=True)
        ]
        top = max(total for total, _ in scored)
        tied = [gpu for total, gpu in scored if total == top]
        # The max-score picker shuffles before its stable sort: a tie goes at random.
        first = tied[int(self.rng.random() * len(tied))] if len(tied) > 1 else tied[0]
        rest = heapq.nlargest(FALLBACKS + 1, scored, key=_total)
        ranked: list[Child] = [first, *(g for _, g in rest if g is not first)]
        return ranked[: FALLBACKS + 1]


def _total(item: tuple[float, GpuChild]) -> float:
    return item[0]
