"""CompletionTimePicker: the local tier's default policy.

For each candidate GPU it estimates when this request would finish there
(``local_lb.cost.gpu_completion_s``):

    expected_completion_s = this request's work × (requests sharing the GPU + 1)
                            / (hardware speed × A100 rate × weight × slow-start share)

Under continuous batching a request does not queue behind the work in flight:
it runs beside it, so what slows it is how many sequences share the GPU
(processor sharing). *Sharing* is what this tier has in flight there, or what
the GPU reports running and waiting when that is more (other routers); a stale
report counts as half busy, never idle. *This request's work* is its decode
tokens plus the prefill of the prompt tokens the GPU does not already cache, so
prefix-cache affinity is part of the same cost rather than a cache-first rule
behind a load threshold: a warm GPU wins exactly while the prefill it saves
outweighs the batch it joins. The *speed* is the hardware class's (× the
configured throttle), so an H100 takes about twice an A100's share with no
hand-set weights; the learned rate is not used to rank (it is throughput at
whatever batch a GPU ran, and ranking by it fed the GPU holding the biggest
batch: the fleet simulator's finding). A GPU slower than its class holds its
requests longer and its count grows. An operator's weight (Admin
``SetWeight``, default 1) multiplies the speed. Ties go to a random candidate.

A request longer than the zone's typical one (``LocalView.typical_work``) ranks by
its completion time weighted by the GPU's slowness, the more the longer it is
(``local_lb.cost.long_request_weight``): completion time alone chooses between a fast
and a slow GPU the same way for every length, and long generations on slow GPUs were
the tail (on one mixed zone at 85 % load, without it P99 was 1.25x, nginx's weighted
``least_conn`` 1.13x: ``bench.zone_peers``); short requests take the slower GPUs' slots.

Candidates (power of d choices, never the whole fleet): the session's GPU
from a consistent-hash ring with bounded loads, up to four GPUs whose prefix
index matches the prompt, and ``sample_size`` (8) random GPUs with a free slot:
in a zone of up to 8 that is every GPU with room, in a larger one a sample.
All are ranked by the same cost; the session's GPU wins a tie. It used to be
ranked first whenever it had a free slot, and on real GPUs with sessions whose
turns share no prefix that cost more tail latency than the rest of the policy
won (issue 11): what a session's GPU really saves is the prefill of the
context it caches, and the prefix index already credits that in the cost.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.request.children import Child
from common.request.pick import PickRequest
from common.request.prefix import BLOCK_TOKENS
from local_lb.cost import gpu_completion_s, long_request_weight, request_work, sharing
from local_lb.session import DEFAULT_EPSILON, BoundedLoadRing
from local_lb.state import FreePool, GpuChild, LocalView


@dataclass
class CompletionTimePicker:
    """Least expected completion time over sampled and affinity candidates."""

    view: LocalView
    # Random GPUs with a free slot ranked beside the affinity candidates: enough that a
    # zone's least busy GPUs are usually among them (first tokens wait less), few enough that a
    # pick never scans a large zone.
    sample_size: int = 8
    affinity_limit: int = 4
    epsilon: float = DEFAULT_EPSILON
    # How much more a longer request prefers a faster GPU (local_lb.cost.long_request_weight).
    length_bias: float = 0.5
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.ring = BoundedLoadRing((g.name for g in self.view.gpus), epsilon=self.epsilon)

    def session_gpu(self, session: str, pool: Sequence[Child]) -> GpuChild | None:
        view = self.view
        name = self.ring.lookup(
            session,
            load=lambda n: view.by_name[n].outstanding_requests,
            total_load=view.inflight_total,
            eligible=lambda n: view.by_name[n] in pool,
        )
        return view.by_name[name] if name is not None else None

    def cost(self, gpu: GpuChild, request: PickRequest, cached_blocks: int, now: float) -> float:
        """When ``request`` would finish on ``gpu``, which caches its first blocks."""
        uncached_work = request_work(request.prompt_tokens, request.output_tokens)
        return self._cost(gpu, request, cached_blocks, uncached_work, now)

    def _cost(
        self, gpu: GpuChild, request: PickRequest, blocks: int, uncached_work: float, now: float
    ) -> float:
        """``cost``, the work of the request uncached computed once for all candidates.
        A method, not a closure: compiled with mypyc (``sim.native``) a closure made per
        request and its environment hold each other, a cycle for the cyclic GC."""
        work = (
            request_work(request.prompt_tokens, request.output_tokens, blocks * BLOCK_TOKENS)
            if blocks
            else uncached_work
        )
        view = self.view
        shared = sharing(gpu.outstanding_requests, view.reported_requests(gpu, now), gpu.slots)
        seconds = gpu_completion_s(gpu, work, shared)
        return seconds * long_request_weight(gpu, work, view.typical_work, self.length_bias)

    def rank(self, request: PickRequest, children: Sequence[Child], now: float) -> list[Child]:
        pool = children if isinstance(children, FreePool) else FreePool.of(children)
        if not pool:
            return []
        cached = (
            self.view.prefix.matches(request.prefix_blocks, self.affinity_limit)
            if request.prefix_blocks
            else {}
        )
        candidates: dict[str, GpuChild] = {}
        sticky = self.session_gpu(request.session, pool) if request.session else None
        if sticky is not None:
            candidates[sticky.name] = sticky
        for name in cached:
            gpu = self.view.by_name.get(name)
            if gpu is not None and gpu in pool:
                candidates[name] = gpu
        for gpu in pool.sample(self.sample_size, self.rng):
            candidates[gpu.name] = gpu
        # Ties (idle GPUs of one class) go to the session's GPU, else a random one,
        # not always the first listed.
        cost, rand = self._cost, self.rng.random
        uncached_work = request_work(request.prompt_tokens, request.output_tokens)
        ranked = sorted(
            candidates.values(),
            key=lambda g: (
                cost(g, request, cached.get(g.name, 0), uncached_work, now),
                g is not sticky,
                rand(),
            ),
        )
        return list(ranked)
