"""An emulated GPU serving an LLM with continuous batching (pure asyncio, no I/O).

The cost model is in seconds on an A100 (speed 1.0); every duration is divided
by the GPU's ``speed`` and multiplied by ``time_scale``. One engine step
decodes one token for every running sequence and also prefills the sequences
admitted at that step, so a request's first token arrives after its prefill:

    step_s = DECODE_STEP_BASE_S + DECODE_STEP_PER_SEQ_S * batch
             + PREFILL_S_PER_TOKEN * uncached prompt tokens of the sequences admitted now

(~10 tokens = 40-50 ms, 512 tokens = 2-3 s on an A100 at batch 1.)
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from common.config.gpu import GpuConfig
from common.request.prefix import BLOCK_TOKENS, prompt_block_hashes
from sim.prefix_cache import PrefixCache

PREFILL_S_PER_TOKEN = 0.0002
DECODE_STEP_BASE_S = 0.004
DECODE_STEP_PER_SEQ_S = 0.0002
# vLLM's default KV block size; prefix caching works on whole blocks only.
# If the event loop falls further behind the emulated timeline than this (a
# stalled process), forgive the debt instead of bursting steps to catch up.
MAX_LAG_S = 0.1

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not "
    "have which one all were we when there can more if will would about so what up "
    "out into time only new some could these two may then do first any like now my "
    "such make over our even most made after also did many before must through back"
).split()


class EngineError(Exception):
    """Base of the engine's request failures."""


class RequestTooLarge(EngineError):
    """The request's KV reservation exceeds the whole KV cache: it can never run here."""


class EngineStopped(EngineError):
    """The engine is not running (not started yet, or stopped while the request waited)."""


def step_cost_s(batch: int, prefill_tokens: int) -> float:
    """Duration of one engine step on an A100 at time scale 1."""
    return DECODE_STEP_BASE_S + DECODE_STEP_PER_SEQ_S * batch + PREFILL_S_PER_TOKEN * prefill_tokens


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine (or of one model on it)."""

    running: int
    waiting: int
    kv_reserved_tokens: int
    kv_capacity_tokens: int
    requests_total: int
    requests_succeeded_total: int
    prompt_tokens_total: int
    prefix_cache_hit_tokens: int
    tokens_generated_total: int

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_reserved_tokens / self.kv_capacity_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hit_tokens / self.prompt_tokens_total
            if self.prompt_tokens_total
            else 0.0
        )


@dataclass
class _Counters:
    requests_total: int = 0
    requests_succeeded_total: int = 0
    prompt_tokens_total: int = 0
    prefix_cache_hit_tokens: int = 0
    tokens_generated_total: int = 0


@dataclass(eq=False)
class _Sequence:
    model: str
    prompt_tokens: int
    max_tokens: int
    # Where its answer ends (an emulated end-of-sequence), at most max_tokens.
    stop_at: int
    block_hashes: list[int]
    rng: random.Random
    out: asyncio.Queue[str | EngineError] = field(default_factory=asyncio.Queue)
    generated: int = 0
    uncached_tokens: int = 0
    done: bool = False

    @property
    def reservation(self) -> int:
        return self.prompt_tokens + self.max_tokens


class GpuEngine:
    """One GPU: a FIFO wait queue, a continuous batch bounded by KV cache and concurrency.

    A request reserves ``prompt + max_tokens`` KV tokens for its whole life (no
    preemption, no sharing of cached prefix blocks in the reservation, so usage
    is conservative). The head of the queue is admitted when its reservation fits
    and a concurrency slot is free; nothing behind it jumps ahead (strict FIFO).
    The prefix cache remembers the last ``prefix_cache_blocks`` prompt blocks
    prefilled (default: as many as the KV cache holds) so a repeated prefix skips
    prefill. One step task runs while there is work and waits on an event when idle;
    its timeline is deadline-based, so event-loop jitter does not accumulate.
    """

    def __init__(
        self,
        gpu: GpuConfig,
        *,
        time_scale: float = 1.0,
        prefix_cache_blocks: int | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.gpu = gpu
        self.time_scale = time_scale
        self.prefix_cache = PrefixCache(
            prefix_cache_blocks
            if prefix_cache_blocks is not None
            else max(1, gpu.kv_cache_tokens // BLOCK_TOKENS)
        )
        self._clock = clock
        self._sleep = sleep
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._reserved = 0
        self._total = _Counters()
        self._by_model: dict[str, _Counters] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._step_loop(), name=f"engine-{self.gpu.name}")

    async def stop(self) -> None:
        """Stop stepping; every pending request fails with ``EngineStopped``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for seq in [*self._running, *self._waiting]:
            seq.done = True
            seq.out.put_nowait(EngineStopped(f"GPU {self.gpu.name} stopped"))
        self._running.clear()
        self._waiting.clear()
        self._reserved = 0

    # ------------------------------------------------------------------ requests

    async def generate(
        self, prompt: str, max_tokens: int, *, model: str = "", answer_tokens: int | None = None
    ) -> AsyncGenerator[str, None]:
        """Yield ``max_tokens`` fake tokens, one per engine step; fewer when
        ``answer_tokens`` ends the answer first (the model's end of sequence: the KV
        reservation is still ``prompt + max_tokens``). Raises ``RequestTooLarge`` or
        ``EngineStopped`` at the first iteration. Closing or cancelling the iteration
        frees the request's KV reservation; wrap it in ``contextlib.aclosing`` when
        breaking out early."""
        seq = self._submit(prompt, max_tokens, model)
        if answer_tokens is not None:
            seq.stop_at = max(1, min(max_tokens, answer_tokens))
        try:
            for _ in range(seq.stop_at):
                item = await seq.out.get()
                if isinstance(item, EngineError):
                    raise item
                yield item
        finally:
            self._release(seq)

    def _submit(self, prompt: str, max_tokens: int, model: str) -> _Sequence:
        if self._task is None or self._wake is None:
            raise EngineStopped(f"GPU {self.gpu.name} is not running")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        prompt_tokens = len(prompt.split())
        if prompt_tokens + max_tokens > self.gpu.kv_cache_tokens:
            raise RequestTooLarge(
                f"request needs {prompt_tokens} prompt + {max_tokens} new tokens of KV cache "
                f"but GPU {self.gpu.name} holds only {self.gpu.kv_cache_tokens}; "
                "shorten the prompt or lower max_tokens"
            )
        seed = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
        seq = _Sequence(
            model=model,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stop_at=max_tokens,
            block_hashes=prompt_block_hashes(prompt, model=model),
            rng=random.Random(int.from_bytes(seed, "little")),
        )
        for counters in self._counters(model):
            counters.requests_total += 1
        self._waiting.append(seq)
        self._wake.set()
        return seq

    def _release(self, seq: _Sequence) -> None:
        """Forget a sequence that ended early (consumer gone); no-op once finished."""
        if seq.done:
            return
        seq.done = True
        if seq in self._running:
            self._running.remove(seq)
            self._reserved -= seq.reservation
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if self._wake is not None:
            self._wake.set()  # freed KV may admit a waiter

    # ------------------------------------------------------------------ step loop

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def _scaled(self, seconds: float) -> float:
        return seconds * self.time_scale / self.gpu.speed

    def _admit(self) -> list[_Sequence]:
        admitted = []
        while self._waiting and len(self._running) < self.gpu.max_concurrency:
            seq = self._waiting[0]
            if self._reserved + seq.reservation > self.gpu.kv_cache_tokens:
                break
            self._waiting.popleft()
            self._running.append(seq)
            self._reserved += seq.reservation
            hit = self.prefix_cache.cached_blocks(seq.block_hashes) * BLOCK_TOKENS
            seq.uncached_tokens = seq.prompt_tokens - hit
            for counters in self._counters(seq.model):
                counters.prompt_tokens_total += seq.prompt_tokens
                counters.prefix_cache_hit_tokens += hit
            admitted.append(seq)
        return admitted

    async def _step_loop(self) -> None:
        assert self._wake is not None
        deadline = self._now()
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                deadline = self._now()
            admitted = self._admit()
            if not self._running:
                # Only reachable with max_concurrency < 1: wait instead of spinning.
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = sum(seq.uncached_tokens for seq in admitted)
            cost = self._scaled(step_cost_s(len(self._running), prefill))
            deadline = max(deadline, self._now() - MAX_LAG_S) + cost
            await self._sleep(max(0.0, deadline - self._now()))
            self._finish_step(admitted)

    def _finish_step(self, admitted: list[_Sequence]) -> None:
        # A sequence cancelled during the sleep already left _running.
        for seq in admitted:
            if not seq.done:
                self.prefix_cache.insert(seq.block_hashes)
        finished = []
        for seq in self._running:
            seq.out.put_nowait(_WORDS[seq.rng.randrange(len(_WORDS))])
            seq.generated += 1
            for counters in self._counters(seq.model):
                counters.tokens_generated_total += 1
            if seq.generated >= seq.stop_at:
                finished.append(seq)
        for seq in finished:
            seq.done = True
            self._running.remove(seq)
            self._reserved -= seq.reservation
            for counters in self._counters(seq.model):
                counters.requests_succeeded_total += 1

    # ------------------------------------------------------------------ stats

    def _counters(self, model: str) -> tuple[_Counters, _Counters]:
        """The GPU-wide and the per-model counters, which every event updates alike."""
        per_model = self._by_model.get(model)
        if per_model is None:
            per_model = self._by_model[model] = _Counters()
        return self._total, per_model

    def stats(self, model: str | None = None) -> EngineStats:
        """Totals for the GPU, or for one model (KV figures are always GPU-wide)."""
        if model is None:
            counters = self._total
            running, waiting = len(self._running), len(self._waiting)
        else:
            counters = self._by_model.get(model, _Counters())
            running = sum(1 for s in self._running if s.model == model)
            waiting = sum(1 for s in self._waiting if s.model == model)
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_reserved_tokens=self._reserved,
            kv_capacity_tokens=self.gpu.kv_cache_tokens,
            requests_total=counters.requests_total,
            requests_succeeded_total=counters.requests_succeeded_total,
            prompt_tokens_total=counters.prompt_tokens_total,
            prefix_cache_hit_tokens=counters.prefix_cache_hit_tokens,
            tokens_generated_total=counters.tokens_generated_total,
        )

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self._reserved / self.gpu.kv_cache_tokens

    @property
    def requests_total(self) -> int:
        return self._total.requests_total

    @property
    def tokens_generated_total(self) -> int:
        return self._total.tokens_generated_total

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self._total.prefix_cache_hit_tokens

    @property
    def prompt_tokens_total(self) -> int:
        return self._total.prompt_tokens_total
