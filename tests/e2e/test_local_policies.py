"""Shared-prefix traffic through a real fleet: the default policy keeps prefixes warm."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable

import grpc

from cli.launcher import Fleet
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.v2 import generate_request
from tests.client import gpu_metric
from tests.conftest import small_fleet_spec

SYSTEM_PROMPTS = 40
REQUESTS = 320
CONCURRENCY = 8


def worker_counters(fleet: Fleet) -> tuple[float, float]:
    """(prefix-cache hit tokens, prompt tokens) summed over every GPU's /metrics."""
    hits = gpu_metric(fleet, "meridian_sim_prefix_cache_hit_tokens_total")
    return hits, gpu_metric(fleet, "vllm:prompt_tokens_total")


async def shared_prefix_load(address: str) -> list[float]:
    rng = random.Random(5)
    systems = [" ".join(f"sys{p}w{i}" for i in range(320)) for p in range(SYSTEM_PROMPTS)]
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def client() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                prompt = (
                    rng.choice(systems)
                    + f" user {i} "
                    + " ".join(rng.choice("abcdefgh") for _ in range(8))
                )
                start = time.perf_counter()
                await stub.ModelInfer(generate_request("demo-llm", prompt, 8), timeout=60)
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return latencies


def run(fleet_factory: Callable[..., Fleet], policy: str) -> tuple[float, float]:
    spec = small_fleet_spec(regions=1, zones=1, gpus=4)
    spec["time_scale"] = 0.2
    for gpu in spec["regions"][0]["zones"][0]["gpus"]:
        # A prefix cache of 512 blocks holds about 25 of the 40 system prompts: a
        # policy that sprays every prompt over every GPU thrashes it.
        gpu["kv_cache_tokens"] = 8192
    fleet = fleet_factory(spec, policy)
    latencies = asyncio.run(shared_prefix_load(fleet.global_address))
    hits, prompts = worker_counters(fleet)
    return hits / prompts, statistics.median(latencies)


def test_default_policy_hits_the_prefix_cache_more_than_least_connections(
    fleet_factory: Callable[..., Fleet],
) -> None:
    # Two interleaved rounds; a policy's latency is its better round's median, since
    # noise from other work on a shared 2-core machine only ever adds latency.
    rounds = [run(fleet_factory, policy) for policy in ("default", "least_connections") * 2]
    default_hit, baseline_hit = rounds[0][0], rounds[1][0]
    default_p50 = min(rounds[0][1], rounds[2][1])
    baseline_p50 = min(rounds[1][1], rounds[3][1])
    print(
        f"hit rate default {default_hit:.2f} vs least_connections {baseline_hit:.2f}; "
        f"p50 {1000 * default_p50:.1f} ms vs {1000 * baseline_p50:.1f} ms"
    )
    assert default_hit > baseline_hit + 0.05
    # Latency no worse: the runs are sequential on a noisy 2-core machine, so the
    # comparison allows 30 % of noise beyond what the better round leaves.
    assert default_p50 <= 1.3 * baseline_p50
