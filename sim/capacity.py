"""A fleet's capacity in requests per second, from the GPU cost model.

Load levels are fractions of this figure, so it must not depend on the policy
being measured: it assumes no prefix-cache hits (a policy that keeps prefixes
warm sees less effective load than the level says; one that does not, exactly
it). Per GPU, at the largest batch its concurrency and KV cache allow for the
mean request, one request costs its share of the batch's decode steps plus its
whole prefill (a prefill step stalls the whole batch):

    seconds per request = output × step(batch) / batch + prompt × PREFILL_S_PER_TOKEN
    capacity = speed / seconds per request
"""

from __future__ import annotations

from collections.abc import Iterable

from common.config.gpu import GpuConfig
from sim.engine import PREFILL_S_PER_TOKEN, step_cost_s


def gpu_capacity_rps(gpu: GpuConfig, mean_prompt: float, mean_output: float) -> float:
    """Requests per second ``gpu`` finishes when always full of mean-sized requests."""
    batch = max(
        1, min(gpu.max_concurrency, int(gpu.kv_cache_tokens // (mean_prompt + mean_output)))
    )
    per_request_s = mean_output * step_cost_s(batch, 0) / batch + mean_prompt * PREFILL_S_PER_TOKEN
    return gpu.speed / per_request_s


def fleet_capacity_rps(gpus: Iterable[GpuConfig], mean_prompt: float, mean_output: float) -> float:
    return sum(gpu_capacity_rps(g, mean_prompt, mean_output) for g in gpus)
