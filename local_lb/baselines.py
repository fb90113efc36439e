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


def _load_key(item: tuple[float, GpuChild]) -> float:
    return item[0]


def nginx_weight(speed: float) -> int:
    """The integer ``weight=`` an operator writes for a GPU of this speed (nginx takes
    integers only): ten per A100, so V100 = 6, H100 = 20, H200 = 23."""
    return max(1, round(10 * speed))


@dataclass
class WeightedLeastConnectionsPicker:
    """nginx ``least_conn`` with ``weight=`` from hardware speed (``nginx_weight``).

    As nginx's upstream module does: the GPU with the fewest active connections
    per unit of weight wins (``conns / weight``, compared by cross-multiplying the
    integers, so ties are exact); when several tie, they are tried in turn by
    smooth weighted round robin among the tied ones only (each tied GPU adds its
    weight to its current weight, the largest wins and pays back the tied total;
    a GPU that wins alone keeps its current weight untouched). Connections are
    this tier's outstanding requests. The weight is static: a GPU slowed by
    long prompts or mid-run throttling keeps its share of connections."""

    _current: dict[str, int] = field(default_factory=dict)
    _weights: dict[float, int] = field(default_factory=dict)  # speed -> weight, memoised

    def weight(self, gpu: GpuChild) -> int:
        weight = self._weights.get(gpu.speed)
        if weight is None:
            weight = self._weights[gpu.speed] = nginx_weight(gpu.speed)
        return weight

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        pool = _pool(children)
        tied: list[tuple[GpuChild, int]] = []
        loads: list[tuple[float, GpuChild]] = []
        best_conns, best_weight = 0, 1
        for gpu in pool:
            conns, weight = gpu.outstanding_requests, self.weight(gpu)
            loads.append((conns / weight, gpu))
            if not tied or conns * best_weight < best_conns * weight:
                tied = [(gpu, weight)]
                best_conns, best_weight = conns, weight
            elif conns * best_weight == best_conns * weight:
                tied.append((gpu, weight))
        if not tied:
            return []
        first = tied[0][0] if len(tied) == 1 else self._smooth_round_robin(tied)
        rest = heapq.nsmallest(FALLBACKS + 1, loads, key=_load_key)
        ranked: list[Child] = [first, *(g for _, g in rest if g is not first)]
        return ranked[: FALLBACKS + 1]

    def _smooth_round_robin(self, tied: list[tuple[GpuChild, int]]) -> GpuChild:
        current = self._current
        total = 0
        best = tied[0][0]
        best_current = -(1 << 62)
        for gpu, weight in tied:
            value = current.get(gpu.name, 0) + weight
            current[gpu.name] = value
            total += weight
            if value > best_current:
                best, best_current = gpu, value
        current[best.name] -= total
        return best


@dataclass
class EnvoyLeastRequestPicker:
    """Envoy's ``LEAST_REQUEST`` load balancer, from its documentation and source.

    Weights: Envoy's default configuration gives endpoints no
    ``load_balancing_weight`` (all equal), and that is what ``weighted=False``
    models and what the ``envoy_least_request`` policy uses: nginx is compared
    *with* hardware weights, Envoy as fleets deploy it out of the box.
    ``weighted=True`` gives each GPU its hardware speed as weight instead
    (the ``envoy_least_request_weighted`` policy).

    All weights equal: ``choice_count`` (2) GPUs drawn at random *with
    replacement*, the one with fewer active requests wins, a tie keeps the first
    drawn. O(1); the most loaded GPU wins only when every draw is it.

    Unequal weights: an earliest-deadline-first schedule over the GPUs serving
    the model, each entry's weight computed when it is (re)inserted as
    ``weight / (active + 1) ** active_request_bias`` (bias 1.0): the GPU with the
    earliest deadline is picked and re-inserted at ``its deadline + 1 / weight``.
    A popped GPU with no free slot here is re-inserted and the next one taken, as
    Envoy re-picks a host its retry predicate rejects. Other entries keep the
    weight of their last insertion, so a GPU whose load changed since is judged
    on the old figure (Envoy's known approximation). O(log n) per pick, and
    O(pool) for the fallbacks (the GPUs of highest current weight).
    """

    rng: random.Random
    view: LocalView
    weighted: bool = False
    choice_count: int = 2
    active_request_bias: float = 1.0
    _schedules: dict[str, tuple[tuple[GpuChild, ...], list[tuple[float, int, GpuChild]]]] = field(
        default_factory=dict
    )
    _order: int = 0

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        pool = _pool(children)
        if not pool:
            return []
        if self.weighted:
            return self._edf(request.model, pool)
        items = pool
        n = len(items)
        drawn = [items[int(self.rng.random() * n)] for _ in range(self.choice_count)]
        best = drawn[0]
        for gpu in drawn[1:]:
            if gpu.outstanding_requests < best.outstanding_requests:
                best = gpu
        others = [g for g in dict.fromkeys(drawn) if g is not best]
        return [best, *others]

    def host_weight(self, gpu: GpuChild) -> float:
        """Envoy's dynamic weight: ``weight / (active + 1) ** bias``."""
        active = gpu.outstanding_requests + 1
        if self.active_request_bias == 1.0:
            return gpu.speed / active
        return float(gpu.speed / active**self.active_request_bias)

    def _schedule(self, model: str) -> list[tuple[float, int, GpuChild]]:
        gpus = self.view.by_model.get(model, ())
        known = self._schedules.get(model)
        if known is None or known[0] is not gpus:
            heap = []
            for gpu in gpus:  # Envoy starts every host at deadline 1 / weight
                heap.append((1.0 / self.host_weight(gpu), self._next(), gpu))
            heapq.heapify(heap)
            known = self._schedules[model] = (gpus, heap)
        return known[1]

    def _next(self) -> int:
        self._order += 1
        return self._order

    def _edf(self, model: str, pool: FreePool) -> list[Child]:
        heap = self._schedule(model)
        for _ in range(len(heap)):
            deadline, _, gpu = heap[0]
            heapq.heapreplace(heap, (deadline + 1.0 / self.host_weight(gpu), self._next(), gpu))
            if gpu in pool:
                rest = heapq.nsmallest(
                    FALLBACKS,
                    (g for g in pool if g is not gpu),
                    key=lambda g: -self.host_weight(g),
                )
                return [gpu, *rest]
        return list(pool.sample(FALLBACKS + 1, self.rng))  # pool GPUs not in the view
