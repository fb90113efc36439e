"""GpuEngine: cost model, continuous batching, KV bound, prefix cache, cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from common.config.gpu import GpuConfig
from common.config.node import Endpoint
from sim.engine import (
    BLOCK_TOKENS,
    DECODE_STEP_BASE_S,
    DECODE_STEP_PER_SEQ_S,
    PREFILL_S_PER_TOKEN,
    EngineStopped,
    GpuEngine,
    RequestTooLarge,
    prompt_block_hashes,
    step_cost_s,
)
from tests.until import until


def gpu(hardware: str = "A100", **overrides: int) -> GpuConfig:
    return GpuConfig(
        name=f"gpu-{hardware.lower()}",
        endpoint=Endpoint("127.0.0.1", 0),
        metrics_endpoint=Endpoint("127.0.0.1", 0),
        hardware=hardware,
        models=("m",),
        **overrides,
    )


def words(n: int, offset: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(offset, offset + n))


class VirtualTime:
    """A clock that advances only when the engine sleeps: exact, instant timelines."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        await asyncio.sleep(0)


async def collect(engine: GpuEngine, prompt: str, max_tokens: int) -> list[str]:
    return [t async for t in engine.generate(prompt, max_tokens)]


@pytest.fixture
async def engine_factory() -> AsyncIterator[Callable[..., GpuEngine]]:
    """Builds started engines; stops them all and checks nothing leaked."""
    engines: list[GpuEngine] = []

    def make(config: GpuConfig | None = None, **kwargs: object) -> GpuEngine:
        engine = GpuEngine(config or gpu(), **kwargs)  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in engines:
            leaked = (engine.running, engine.waiting, engine.kv_cache_usage)
            await engine.stop()
            assert leaked == (0, 0, 0.0), f"{engine.gpu.name} leaked requests or KV: {leaked}"


@pytest.mark.parametrize(
    ("batch", "prefill", "expected"),
    [
        (1, 0, DECODE_STEP_BASE_S + DECODE_STEP_PER_SEQ_S),
        (8, 0, DECODE_STEP_BASE_S + 8 * DECODE_STEP_PER_SEQ_S),
        (1, 100, DECODE_STEP_BASE_S + DECODE_STEP_PER_SEQ_S + 100 * PREFILL_S_PER_TOKEN),
    ],
)
def test_step_cost(batch: int, prefill: int, expected: float) -> None:
    assert step_cost_s(batch, prefill) == pytest.approx(expected)


def test_ten_tokens_cost_about_45ms_on_a100() -> None:
    assert 0.040 <= 10 * step_cost_s(1, 0) + 10 * PREFILL_S_PER_TOKEN <= 0.050


def test_block_hashes_cover_whole_blocks_only() -> None:
    assert len(prompt_block_hashes(words(BLOCK_TOKENS - 1))) == 0
    assert len(prompt_block_hashes(words(3 * BLOCK_TOKENS + 5))) == 3


def test_block_hashes_are_chained() -> None:
    a = prompt_block_hashes(words(3 * BLOCK_TOKENS))
    b = prompt_block_hashes(words(BLOCK_TOKENS) + " x " + words(2 * BLOCK_TOKENS - 1, 1000))
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


def test_block_hashes_depend_on_model_and_ignore_spacing() -> None:
    prompt = words(BLOCK_TOKENS)
    assert prompt_block_hashes(prompt, model="a") != prompt_block_hashes(prompt, model="b")
    assert prompt_block_hashes("  " + prompt.replace(" ", "\n")) == prompt_block_hashes(prompt)


async def test_exactly_max_tokens_and_deterministic(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory(time_scale=0.01)
    await engine.start()
    first = await collect(engine, "tell me a story", 37)
    second = await collect(engine, "tell me a story", 37)
    assert len(first) == 37 and all(t and " " not in t for t in first)
    assert first == second
    stats = engine.stats()
    assert stats.tokens_generated_total == 74
    assert stats.requests_total == stats.requests_succeeded_total == 2


async def test_h100_is_about_twice_as_fast_as_a100(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    a100, h100 = engine_factory(gpu("A100")), engine_factory(gpu("H100"))
    await a100.start()
    await h100.start()

    async def job(engine: GpuEngine) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(collect(engine, words(100, 100 * i), 40) for i in range(4)))
        return time.perf_counter() - start

    a100_s, h100_s = await asyncio.gather(job(a100), job(h100))
    assert 1.4 <= a100_s / h100_s <= 2.8, (a100_s, h100_s)


async def test_repeated_prompt_hits_prefix_cache_and_prefills_cheaper(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    vt = VirtualTime()
    engine = engine_factory(clock=vt.clock, sleep=vt.sleep)
    await engine.start()
    prompt = words(20 * BLOCK_TOKENS + 7)  # 327 tokens: 20 whole blocks + a partial one

    async def first_token_s() -> float:
        start = vt.now
        async for _ in engine.generate(prompt, 1):
            pass
        return vt.now - start

    cold, warm = await first_token_s(), await first_token_s()
    assert cold == pytest.approx(step_cost_s(1, 327))
    assert warm == pytest.approx(step_cost_s(1, 7))  # the partial block is never cached
    stats = engine.stats()
    assert stats.prompt_tokens_total == 2 * 327
    assert stats.prefix_cache_hit_tokens == 20 * BLOCK_TOKENS
    assert stats.prefix_cache_hit_rate == pytest.approx(320 / 654)


async def test_prefix_cache_is_lru_bounded(engine_factory: Callable[..., GpuEngine]) -> None:
    vt = VirtualTime()
    engine = engine_factory(prefix_cache_blocks=4, clock=vt.clock, sleep=vt.sleep)
    await engine.start()
    await collect(engine, words(4 * BLOCK_TOKENS), 1)
    await collect(engine, words(4 * BLOCK_TOKENS, 5000), 1)  # evicts the first prompt
    await collect(engine, words(4 * BLOCK_TOKENS), 1)
    assert len(engine.prefix_cache) == 4
    assert engine.prefix_cache_hit_tokens == 0


async def test_kv_bound_puts_excess_requests_in_waiting(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory(gpu(kv_cache_tokens=100), time_scale=0.05)
    await engine.start()
    # Each reserves 10 prompt + 40 new = 50 tokens: two fit, the third waits.
    tasks = [asyncio.create_task(collect(engine, words(10, 10 * i), 40)) for i in range(3)]
    await until(lambda: engine.running + engine.waiting == 3, poll_s=0.001)
    assert (engine.running, engine.waiting, engine.kv_cache_usage) == (2, 1, 1.0)
    results = await asyncio.gather(*tasks)
    assert [len(r) for r in results] == [40, 40, 40]


async def test_concurrency_bound_puts_excess_requests_in_waiting(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory(gpu(max_concurrency=2), time_scale=0.05)
    await engine.start()
    tasks = [asyncio.create_task(collect(engine, "hi", 40)) for _ in range(5)]
    await until(lambda: engine.running + engine.waiting == 5, poll_s=0.001)
    assert (engine.running, engine.waiting) == (2, 3)
    assert engine.stats().kv_reserved_tokens == 2 * 41
    await asyncio.gather(*tasks)


async def test_request_larger_than_kv_cache_is_rejected(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory(gpu(kv_cache_tokens=100), time_scale=0.05)
    await engine.start()
    with pytest.raises(RequestTooLarge, match="holds only 100"):
        await collect(engine, words(60), 41)
    assert engine.requests_total == 0


async def test_cancelling_a_running_request_frees_its_kv(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory(time_scale=0.05)
    await engine.start()
    first_token = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(words(50), 5000):
            first_token.set()

    task = asyncio.create_task(consume())
    await first_token.wait()
    assert engine.running == 1 and engine.kv_cache_usage > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (engine.running, engine.kv_cache_usage) == (0, 0.0)
    assert engine.stats().requests_succeeded_total == 0


async def test_cancelling_a_waiting_request_leaves_the_queue(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory(gpu(max_concurrency=1), time_scale=0.05)
    await engine.start()
    running = asyncio.create_task(collect(engine, "a", 200))
    waiting = asyncio.create_task(collect(engine, "b", 200))
    await until(lambda: engine.waiting == 1, poll_s=0.001)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert engine.waiting == 0
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)


async def test_breaking_out_early_frees_kv_on_close(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory(time_scale=0.05)
    await engine.start()
    tokens = engine.generate("x y z", 1000)
    async for _ in tokens:
        break
    await tokens.aclose()
    assert (engine.running, engine.kv_cache_usage) == (0, 0.0)


async def test_engine_not_started_raises() -> None:
    engine = GpuEngine(gpu())
    with pytest.raises(EngineStopped, match="not running"):
        await collect(engine, "hi", 1)


async def test_stop_fails_pending_requests() -> None:
    engine = GpuEngine(gpu(max_concurrency=1), time_scale=0.05)
    await engine.start()
    tasks = [asyncio.create_task(collect(engine, "hi", 10_000)) for _ in range(2)]
    await until(lambda: engine.running == 1 and engine.waiting == 1, poll_s=0.001)
    await engine.stop()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        assert isinstance(result, EngineStopped)
    assert (engine.running, engine.waiting, engine.kv_cache_usage) == (0, 0, 0.0)


async def test_idle_engine_does_not_step(engine_factory: Callable[..., GpuEngine]) -> None:
    vt = VirtualTime()
    engine = engine_factory(clock=vt.clock, sleep=vt.sleep)
    await engine.start()
    await collect(engine, "hi", 3)
    steps = vt.sleeps
    for _ in range(20):
        await asyncio.sleep(0)
    assert steps == vt.sleeps == 3


async def test_stats_per_model(engine_factory: Callable[..., GpuEngine]) -> None:
    engine = engine_factory(time_scale=0.01)
    await engine.start()
    a = [t async for t in engine.generate("one two", 3, model="a")]
    b = [t async for t in engine.generate("one two three", 5, model="b")]
    assert (len(a), len(b)) == (3, 5)
    assert engine.stats("a").tokens_generated_total == 3
    assert engine.stats("b").prompt_tokens_total == 3
    assert engine.stats("unknown").requests_total == 0
    assert engine.stats().tokens_generated_total == 8


async def test_an_answer_ends_at_its_end_of_sequence_holding_its_reservation(
    engine_factory: Callable[..., GpuEngine],
) -> None:
    engine = engine_factory()
    await engine.start()
    tokens = engine.generate("one two", 50, answer_tokens=3)
    first = await anext(tokens)
    assert engine.stats().kv_reserved_tokens == 2 + 50  # reserved for max_tokens
    rest = [t async for t in tokens]
    assert len([first, *rest]) == 3
    stats = engine.stats()
    assert (stats.tokens_generated_total, stats.requests_succeeded_total) == (3, 1)
    assert stats.kv_reserved_tokens == 0  # freed when the answer ended
    # An answer longer than max_tokens stops at max_tokens.
    assert len([t async for t in engine.generate("x", 2, answer_tokens=9)]) == 2
