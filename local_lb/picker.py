"""CompletionTimePicker: the local tier's default policy.

For each candidate GPU it estimates when this request would finish there:

    expected_completion_s = (work ahead + this request's work) / (learned rate × slow-start share)

*Work ahead* is what this tier has in flight on the GPU plus what the GPU
reports waiting from elsewhere (a stale report counts as half busy, never
idle). *This request's work* is its decode tokens plus the prefill of the
prompt tokens the GPU does not already cache, so prefix-cache affinity is part
of the same cost rather than a cache-first rule behind a load threshold: a
warm GPU wins exactly while the prefill it saves outweighs the queue in front
of it. The *rate* is learned per GPU from finished requests (EWMA), seeded from
the hardware class, so an H100 takes about twice an A100's share with no
hand-set weights, and a throttled GPU less. An operator's weight (Admin
``SetWeight``, default 1) multiplies the learned rate.

Candidates (power of d choices, never the whole fleet): the session's GPU
from a consistent-hash ring with bounded loads, up to four GPUs whose prefix
index matches the prompt, and ``sample_size`` random GPUs with a free slot.
The session's GPU, when it has a free slot, is ranked first; the rest by cost.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.request.children import Child
from common.request.pick import PickRequest
from common.request.prefix import BLOCK_TOKENS
from local_lb.cost import gpu_completion_s, outstanding_work, request_work
from local_lb.session import DEFAULT_EPSILON, BoundedLoadRing
from local_lb.state import FreePool, GpuChild, LocalView


@dataclass
class CompletionTimePicker:
    """Least expected completion time over sampled and affinity candidates."""

    view: LocalView
    sample_size: int = 4
    affinity_limit: int = 4
    epsilon: float = DEFAULT_EPSILON
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
        work = request_work(request.prompt_tokens, request.max_tokens, cached_blocks * BLOCK_TOKENS)
        ahead = outstanding_work(
            gpu.outstanding_work,
            gpu.outstanding_requests,
            self.view.reported_requests(gpu, now),
            gpu.slots,
        )
        return gpu_completion_s(gpu, work, ahead)

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
        for name in cached:
            gpu = self.view.by_name.get(name)
            if gpu is not None and gpu in pool:
                candidates[name] = gpu
        for gpu in pool.sample(self.sample_size, self.rng):
            candidates[gpu.name] = gpu
        scored = sorted(
            candidates.values(), key=lambda g: self.cost(g, request, cached.get(g.name, 0), now)
        )
        if request.session:
            sticky = self.session_gpu(request.session, pool)
            if sticky is not None:
                scored = [sticky, *(g for g in scored if g is not sticky)]
        return list(scored)
