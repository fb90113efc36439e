"""The emulated GPU's cost model in simulated time, jumping from event to event.

``sim.engine.GpuEngine`` steps one decode token at a time on a real event loop;
at fleet scale (a million requests of a few hundred tokens each) that would be
hundreds of millions of steps. ``SimGpu`` keeps the engine's rules exactly —
a FIFO wait queue, admission while a concurrency slot is free and the head's
KV reservation fits, one step decoding a token for every
running sequence and prefilling the uncached prompt of the ones admitted at
its start (``sim.engine.step_cost_s``), the same ``PrefixCache`` — but computes
when the next thing changes instead of stepping there: between two events the
batch is fixed, so every step costs the same and the next completion is a
multiplication away.

Steps are counted, not simulated: a running sequence finishes at step index
``end_step`` (a heap), the time of step index k follows from the current
segment (its start, its first step's cost with the prefill, and the regular
step's cost). An arrival while the batch runs is admitted at the next step
boundary, as the engine admits at the top of its loop. A change of speed
(throttling) applies from the next segment.

A request carries the client's cap (``max_tokens``: the GPU refuses one whose
``prompt + max_tokens`` exceeds its KV cache, as vLLM refuses one longer than its
context) and its true length (``output_tokens``), at which it stops. Admission
reserves ``prompt + output_tokens``, the most KV the sequence will hold: an engine
that allocates pages as it decodes (vLLM) needs that much by the end, and this
model has no preemption. The true length stays inside the GPU: what it reports
(``kv_cache_usage``) is the KV allocated so far, prompt plus tokens decoded.

Utilisation is integrated as the GPU goes: ``busy_s`` (time spent stepping)
and ``slot_s`` (running sequences × time).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.config.gpu import GpuConfig
from common.request.prefix import BLOCK_TOKENS
from sim.engine import step_cost_s
from sim.prefix_cache import PrefixCache


class GpuFailed(Exception):
    """The GPU died with this request on it, or was down when it arrived."""


class GpuRefused(Exception):
    """The request can never run on this GPU (its KV reservation exceeds the cache)."""


@dataclass(eq=False, slots=True)
class SimJob:
    """One request on a simulated GPU; ``done`` resolves when its last token is out."""

    prompt_tokens: int
    max_tokens: int
    block_hashes: Sequence[int]
    submitted_at: float
    done: asyncio.Future[None]
    output_tokens: int = 0  # the true length: the job ends after this many tokens
    first_token_at: float = math.nan
    finished_at: float = math.nan
    cached_tokens: int = 0
    end_step: int = 0

    @property
    def reservation(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass
class SimGpu:
    """One GPU as the simulator runs it (see the module docstring)."""

    cfg: GpuConfig
    loop: asyncio.AbstractEventLoop
    time_scale: float = 1.0
    prefix_cache_blocks: int | None = None
    speed: float = field(init=False)
    up: bool = field(init=False)
    busy_s: float = field(init=False)
    slot_s: float = field(init=False)
    prompt_tokens_total: int = field(init=False)
    cached_tokens_total: int = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.cfg.name
        self.speed = self.cfg.speed
        # Set here, not as field defaults: init=False fields with defaults are not
        # set on a class mypyc compiles (sim.native).
        self.up = True
        self.busy_s = self.slot_s = 0.0
        self.prompt_tokens_total = self.cached_tokens_total = 0
        blocks = self.prefix_cache_blocks
        self.prefix_cache = PrefixCache(
            blocks if blocks is not None else max(1, self.cfg.kv_cache_tokens // BLOCK_TOKENS)
        )
        self.waiting: deque[SimJob] = deque()
        self._heap: list[tuple[int, int, SimJob]] = []
        self._order = itertools.count()
        self._reserved = 0
        # KV allocated so far over the running jobs: sum(prompt) + running × k - sum(start).
        self._prompts_running = 0
        self._starts_running = 0
        self._steps = 0  # step index of the last boundary processed
        # The running segment: when it began, at which step, its first and regular costs.
        self._seg_t = 0.0
        self._seg_k = 0
        self._seg_first = 0.0
        self._seg_cost = 0.0
        self._seg_acc = 0.0  # when the integrals were last brought up to date
        self._timer: asyncio.TimerHandle | None = None
        self._timer_k = -1

    # ------------------------------------------------------------------ state

    @property
    def running(self) -> int:
        return len(self._heap)

    @property
    def kv_cache_usage(self) -> float:
        """KV allocated now (every running prompt and the tokens decoded so far), as a
        share of the cache: what vLLM reports, blind to how long each answer will be."""
        k = self._steps_done(self.loop.time())
        allocated = self._prompts_running + len(self._heap) * k - self._starts_running
        return allocated / self.cfg.kv_cache_tokens

    def remaining_tokens(self) -> list[int]:
        """Tokens each running sequence still has to decode (the greedy reference's true state)."""
        k = self._steps_done(self.loop.time())
        return [max(0, end - k) for end, _, _ in self._heap]

    def step_s(self, batch: int, prefill_tokens: int = 0) -> float:
        """One step's duration here at ``batch`` (the engine's formula, at this speed)."""
        return step_cost_s(batch, prefill_tokens) * self.time_scale / self.speed

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        block_hashes: Sequence[int],
        output_tokens: int | None = None,
    ) -> SimJob:
        """Queue a request that stops after ``output_tokens`` (None: ``max_tokens``, a
        client that asked for exactly its answer's length); raises GpuFailed when down,
        GpuRefused when ``prompt + max_tokens`` cannot fit."""
        output = max_tokens if output_tokens is None else output_tokens
        if not 0 <= output <= max_tokens:
            raise ValueError(f"output_tokens must be in [0, max_tokens={max_tokens}], got {output}")
        if not self.up:
            raise GpuFailed(f"GPU {self.name} is down")
        if prompt_tokens + max_tokens > self.cfg.kv_cache_tokens:
            raise GpuRefused(
                f"request needs {prompt_tokens + max_tokens} KV tokens; "
                f"GPU {self.name} holds {self.cfg.kv_cache_tokens}"
            )
        now = self.loop.time()
        job = SimJob(
            prompt_tokens, max_tokens, block_hashes, now, self.loop.create_future(), output
        )
        head_blocked = bool(self.waiting)
        self.waiting.append(job)
        if not self._heap:
            if self._timer is None:
                self._arm(self._steps, now)  # idle: the engine wakes and steps at once
            # else a step whose every sequence was cancelled is still running: the
            # engine admits at its end, where a boundary is armed.
        elif not head_blocked and self._fits(job):
            k = self._next_boundary(now)
            if k < self._timer_k:
                self._arm(k, self._time_of(k))
        return job

    def cancel(self, job: SimJob) -> None:
        """The caller gave up on ``job`` (a per-try timeout cancelled its call).

        As the engine's ``_release``: a waiting job leaves the queue; a running one
        frees its slot and KV reservation at once, the step under way finishes at its
        cost, and the next step runs the smaller batch and admits whoever now fits. A
        finished or failed job is left alone. One difference is kept: a job cancelled
        during its own prefill step leaves its blocks in the prefix cache (the engine
        caches them only once that step ends; a per-try limit is at least a second,
        a step milliseconds).
        """
        if not math.isnan(job.finished_at) or not self.up:
            return
        if job in self.waiting:
            self.waiting.remove(job)
            if self._heap and self.waiting and self._fits(self.waiting[0]):
                k = self._next_boundary(self.loop.time())
                if k < self._timer_k:
                    self._arm(k, self._time_of(k))  # a new head fits: next step admits it
        else:
            at = next((i for i, (_, _, j) in enumerate(self._heap) if j is job), None)
            if at is None:
                return
            now = self.loop.time()
            k = self._next_boundary(now)
            when = self._time_of(k)
            self._account(now)
            self._heap.pop(at)
            heapq.heapify(self._heap)
            self._left(job)
            if k < self._timer_k:
                self._arm(k, when)  # the batch changes from the next step
        if not job.done.done():
            job.done.cancel()

    def fail(self, reason: str) -> list[SimJob]:
        """The GPU dies: every job on it fails with GpuFailed, the prefix cache is lost."""
        self._account(self.loop.time())
        self.up = False
        jobs = [job for _, _, job in self._heap] + list(self.waiting)
        self._heap.clear()
        self.waiting.clear()
        self._reserved = self._prompts_running = self._starts_running = 0
        self._disarm()
        self.prefix_cache = PrefixCache(self.prefix_cache.capacity_blocks)
        for job in jobs:
            if not job.done.done():
                job.done.set_exception(GpuFailed(f"GPU {self.name} failed: {reason}"))
        return jobs

    def recover(self) -> None:
        self.up = True

    def set_speed(self, speed: float) -> None:
        """A new effective speed (throttling); it applies from the next segment."""
        self.speed = speed

    # ------------------------------------------------------------------ the timeline

    def _fits(self, job: SimJob) -> bool:
        return (
            len(self._heap) < self.cfg.max_concurrency
            and self._reserved + job.reservation <= self.cfg.kv_cache_tokens
        )

    def _time_of(self, k: int) -> float:
        """Simulated time of the boundary after step ``k`` of the current segment."""
        if k <= self._seg_k:
            return self._seg_t
        return self._seg_t + self._seg_first + (k - self._seg_k - 1) * self._seg_cost

    def _steps_done(self, now: float) -> int:
        """Steps of the current segment completed by ``now``."""
        if not self._heap or now < self._seg_t + self._seg_first:
            return self._seg_k
        return self._seg_k + 1 + int((now - self._seg_t - self._seg_first) / self._seg_cost)

    def _next_boundary(self, now: float) -> int:
        """The first step boundary at or after ``now``."""
        k = self._steps_done(now)
        return k if self._time_of(k) >= now else k + 1

    def _arm(self, k: int, when: float) -> None:
        self._disarm()
        self._timer_k = k
        self._timer = self.loop.call_at(when, self._boundary, k)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_k = 1 << 62

    def busy_until(self, now: float) -> float:
        """``busy_s`` with the step under way counted up to ``now`` (``sim.busy_window``)."""
        self._account(now)
        return self.busy_s

    def _account(self, now: float) -> None:
        """Add the time since the segment's start (or the last account) to the integrals."""
        if self._heap:
            elapsed = max(0.0, now - self._seg_acc)
            self.busy_s += elapsed
            self.slot_s += elapsed * len(self._heap)
        self._seg_acc = now

    def _boundary(self, k: int) -> None:
        """Step ``k`` has just ended: finish, admit, and start the next segment."""
        self._timer = None
        self._timer_k = 1 << 62
        now = self.loop.time()
        self._account(now)
        self._steps = k
        heap = self._heap
        while heap and heap[0][0] <= k:
            _, _, job = heapq.heappop(heap)
            self._left(job)
            job.finished_at = now
            if not job.done.done():
                job.done.set_result(None)
        admitted = self._admit(k)
        if not heap:
            return
        prefill = sum(job.prompt_tokens - job.cached_tokens for job in admitted)
        self._seg_t, self._seg_k = now, k
        self._seg_first = self.step_s(len(heap), prefill)
        self._seg_cost = self.step_s(len(heap))
        for job in admitted:
            job.first_token_at = now + self._seg_first
        nxt = heap[0][0]
        self._arm(nxt, self._time_of(nxt))

    def _admit(self, k: int) -> list[SimJob]:
        admitted: list[SimJob] = []
        while self.waiting and self._fits(self.waiting[0]):
            job = self.waiting.popleft()
            self._reserved += job.reservation
            self._prompts_running += job.prompt_tokens
            self._starts_running += k
            job.end_step = k + job.output_tokens
            heapq.heappush(self._heap, (job.end_step, next(self._order), job))
            admitted.append(job)
        # The engine caches a prompt's blocks once its prefill step is done; every
        # sequence admitted together looked the cache up before any was inserted.
        cache = self.prefix_cache
        if len(admitted) == 1:
            self._count_hits(admitted[0], cache.looked_up_and_inserted(admitted[0].block_hashes))
        else:
            for job in admitted:
                self._count_hits(job, cache.cached_blocks(job.block_hashes))
            for job in admitted:
                cache.insert(job.block_hashes)
        return admitted

    def _left(self, job: SimJob) -> None:
        """A running job leaves (done or cancelled): its KV is free."""
        self._reserved -= job.reservation
        self._prompts_running -= job.prompt_tokens
        self._starts_running -= job.end_step - job.output_tokens

    def _count_hits(self, job: SimJob, blocks: int) -> None:
        job.cached_tokens = min(blocks * BLOCK_TOKENS, job.prompt_tokens)
        self.prompt_tokens_total += job.prompt_tokens
        self.cached_tokens_total += job.cached_tokens
