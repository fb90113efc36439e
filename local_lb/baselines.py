"""Baseline GPU pickers: the classic load-balancing policies, for comparison.

Each ranks ``children`` (the balancer passes the model's ``FreePool``: GPUs
with a free slot) and returns its choice first, then up to ``FALLBACKS``
more for the balancer to try if the first cannot be reserved. They are as
simple as the textbook algorithms, O(pool) where the algorithm is (least
connections, least response time, smooth weighted round robin, SGLang's
cache-aware), unlike the default ``CompletionTimePicker``, which samples.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.request.children import Child
from common.request.pick import PickRequest
from common.request.prefix import BLOCK_TOKENS
from local_lb.state import FreePool, GpuChild, LocalView

# Candidates returned after the chosen one.
FALLBACKS = 3


def _pool(children: Sequence[Child]) -> FreePool:
    return children if isinstance(children, FreePool) else FreePool.of(children)


def _least(pool: FreePool, key: Callable[[GpuChild], float], rng: random.Random) -> list[Child]:
    """The ``FALLBACKS + 1`` GPUs of smallest ``key``, ties in random order."""
    best: list[GpuChild] = heapq.nsmallest(
        FALLBACKS + 1, pool, key=lambda g: (key(g), rng.random())
    )
    return list(best)


@dataclass
class RoundRobinPicker:
    """Round robin: a rotating index per model over the view's GPUs serving it; the
    next one clockwise that is in the pool wins and the index moves past it.
    Blind to load and speed: an H100 and a V100 get the same share."""

    view: LocalView
    _next: dict[str, int] = field(default_factory=dict)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        pool = _pool(children)
        gpus = self.view.by_model.get(request.model, ())
        start = self._next.get(request.model, 0)
        ranked: list[Child] = []
        for i in range(len(gpus)):
            gpu = gpus[(start + i) % len(gpus)]
            if gpu in pool:
                if not ranked:
                    self._next[request.model] = (start + i + 1) % len(gpus)
                ranked.append(gpu)
                if len(ranked) > FALLBACKS:
                    break
        return ranked


@dataclass
class WeightedRoundRobinPicker:
    """Smooth weighted round robin (nginx): each GPU in the pool adds its weight
    (its hardware speed) to its current weight; the largest wins and pays back
    the total. Shares follow speed exactly, interleaved; blind to live load."""

    view: LocalView
    _current: dict[str, float] = field(default_factory=dict)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        pool = _pool(children)
        if not pool:
            return []
        current = self._current
        total = 0.0
        best: GpuChild | None = None
        best_current = float("-inf")
        for gpu in pool:
            value = current.get(gpu.name, 0.0) + gpu.speed
            current[gpu.name] = value
            total += gpu.speed
            if value > best_current:
                best, best_current = gpu, value
        assert best is not None
        current[best.name] -= total
        rest = heapq.nlargest(
            FALLBACKS, (g for g in pool if g is not best), key=lambda g: current[g.name]
        )
        return [best, *rest]


@dataclass
class RandomPicker:
    """Uniformly random GPUs from the pool. No state, no load signal."""

    rng: random.Random

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        return list(_pool(children).sample(FALLBACKS + 1, self.rng))


@dataclass
class LeastConnectionsPicker:
    """Fewest outstanding requests from this tier (ties random). Blind to request
    size and GPU speed: a V100 with 3 long requests beats an idle-ish H100 with 4."""

    rng: random.Random

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        return _least(_pool(children), lambda g: g.outstanding_requests, self.rng)


@dataclass
class PowerOfTwoPicker:
    """Power of two choices: two random GPUs from the pool, fewer outstanding
    requests first. O(1); avoids the worst GPU, not the best-for-this-request."""

    rng: random.Random

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        two = _pool(children).sample(2, self.rng)
        return sorted(two, key=lambda g: g.outstanding_requests)


@dataclass
class LeastResponseTimePicker:
    """Lowest latency EWMA (Envoy/NGINX ``least_time``-style). A GPU with no
    latency yet reads 0 and is tried first (ties random). Latency lags load, so
    a fast GPU is flooded until its EWMA catches up."""

    rng: random.Random

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        return _least(_pool(children), lambda g: g.latency_ewma_s, self.rng)


@dataclass
class SglangCacheAwarePicker:
    """SGLang router's cache-aware policy, re-implemented from its documentation
    (no SGLang code used):

    1. If load is imbalanced over the GPUs serving the model (outstanding
       requests: ``max - min > balance_abs_threshold`` and
       ``max > balance_rel_threshold * min``), the shortest queue in the pool.
    2. Else the pool GPU with the longest cached prefix, if its match rate
       (matched tokens / prompt tokens) exceeds ``cache_threshold``.
    3. Else the GPU with the smallest cache tree (most cache room left).

    SGLang keeps an approximate radix tree of text per worker; here the
    view's ``PrefixIndex`` (16-token blocks routed to each GPU, LRU-bounded)
    stands in for it: the match is the GPU's deepest matching block, and
    "tree size" is ``PrefixIndex.blocks_per_gpu``. The threshold rule means a
    busy warm GPU keeps winning until the imbalance check trips.
    """

    view: LocalView
    rng: random.Random
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    match_limit: int = 8

    def imbalanced(self, model: str) -> bool:
        loads = [g.outstanding_requests for g in self.view.by_model.get(model, ())]
        if not loads:
            return False
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def best_match(self, request: PickRequest, pool: FreePool) -> tuple[GpuChild, float] | None:
        """The pool GPU holding the longest prefix of the prompt, and its match rate."""
        if not request.prefix_blocks:
            return None
        matches = self.view.prefix.matches(request.prefix_blocks, limit=self.match_limit)
        best: GpuChild | None = None
        depth = 0
        for name, blocks in matches.items():
            gpu = self.view.by_name.get(name)
            if gpu is not None and gpu in pool and blocks > depth:
                best, depth = gpu, blocks
        if best is None:
            return None
        return best, depth * BLOCK_TOKENS / max(1, request.prompt_tokens)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        pool = _pool(children)
        if not pool:
            return []
        by_load = _least(pool, lambda g: g.outstanding_requests, self.rng)
        if self.imbalanced(request.model):
            return by_load
        match = self.best_match(request, pool)
        if match is not None and match[1] > self.cache_threshold:
            first: Child = match[0]
        else:
            sizes = self.view.prefix.blocks_per_gpu
            first = min(pool, key=lambda g: (sizes.get(g.name, 0), self.rng.random()))
        return [first, *(g for g in by_load if g is not first)][: FALLBACKS + 1]
