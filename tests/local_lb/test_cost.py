"""The local tier's formulas, one case per test."""

import pytest

from common.config.node import Endpoint
from local_lb.cost import (
    A100_WORK_PER_S,
    MAX_LENGTH_EXTRA,
    PREFILL_WEIGHT,
    STALE_BUSY_FRACTION,
    attempt_expected_s,
    capacity_work_per_s,
    drain_rps,
    ewma,
    gpu_completion_s,
    long_request_weight,
    outstanding_work,
    rate_sample,
    request_work,
    sharing,
)
from local_lb.state import GpuChild


def test_a_gpus_capacity_is_its_learned_rate_or_its_hardware_whichever_is_more() -> None:
    gpu = GpuChild(name="g", endpoint=Endpoint("127.0.0.1", 1), models=frozenset({"m"}))
    gpu.speed, gpu.weight = 2.0, 1.0
    gpu.rate = 300.0  # learned at a batch of one or two: not what it can do
    assert capacity_work_per_s(gpu) == 2.0 * A100_WORK_PER_S
    gpu.rate = 9000.0  # faster than the model of its class (a time scale, a newer part)
    assert capacity_work_per_s(gpu) == 9000.0
    gpu.rate, gpu.weight = 300.0, 0.5  # the operator's weight scales the hardware figure
    assert capacity_work_per_s(gpu) == A100_WORK_PER_S


def test_request_work_counts_decode_and_cheap_prefill() -> None:
    assert request_work(100, 10) == pytest.approx(10 + PREFILL_WEIGHT * 100)


def test_cached_prompt_tokens_are_free() -> None:
    assert request_work(100, 10, cached_tokens=64) == pytest.approx(10 + PREFILL_WEIGHT * 36)
    assert request_work(100, 10, cached_tokens=500) == 10


def test_outstanding_work_is_own_work_when_report_agrees() -> None:
    assert outstanding_work(300, 3, reported_requests=3, slots=16) == 300


def test_foreign_requests_valued_at_our_mean_size() -> None:
    # 5 reported, 2 of them ours (mean 100): 3 foreign requests ~ 300 more.
    assert outstanding_work(200, 2, reported_requests=5, slots=16) == 500


def test_stale_report_is_never_idle() -> None:
    stale = outstanding_work(0, 0, reported_requests=None, slots=16)
    fresh_idle = outstanding_work(0, 0, reported_requests=0, slots=16)
    assert fresh_idle == 0
    assert stale == STALE_BUSY_FRACTION * 16 > fresh_idle


def test_sharing_is_own_in_flight_when_the_report_agrees_or_lags() -> None:
    assert sharing(3, reported_requests=3, slots=16) == 3
    assert sharing(3, reported_requests=1, slots=16) == 3  # ours not in the report yet


def test_sharing_counts_other_routers_requests_from_the_report() -> None:
    assert sharing(2, reported_requests=5, slots=16) == 5


def test_sharing_with_a_stale_report_is_never_idle() -> None:
    assert sharing(0, reported_requests=None, slots=16) == STALE_BUSY_FRACTION * 16
    assert sharing(0, reported_requests=0, slots=16) == 0


def test_rate_sample_scales_by_batch() -> None:
    # 100 work in 0.5 s while sharing the GPU with 3 others: the GPU does 800 work/s.
    assert rate_sample(100, 0.5, 4) == pytest.approx(800)


@pytest.mark.parametrize(("work", "elapsed"), [(0, 1.0), (10, 0.0)])
def test_rate_sample_ignores_degenerate_observations(work: float, elapsed: float) -> None:
    assert rate_sample(work, elapsed, 1) is None


def test_ewma_moves_a_fifth_of_the_way() -> None:
    assert ewma(100, 200) == pytest.approx(120)


def gpu(
    speed: float = 1.0, weight: float = 1.0, share: float = 1.0, rate: float = 1.0
) -> GpuChild:
    return GpuChild(
        name="g",
        endpoint=Endpoint("127.0.0.1", 1),
        models=frozenset({"m"}),
        speed=speed,
        rate=rate,
        weight=weight,
        share=share,
    )


def test_gpu_completion_is_own_work_times_the_batch_over_the_hardware_speed() -> None:
    # 100 work beside 9 others on an A100: 100 x 10 / 2000 work/s.
    assert gpu_completion_s(gpu(), 100.0, 9.0) == pytest.approx(100 * 10 / A100_WORK_PER_S)
    assert gpu_completion_s(gpu(speed=2.0), 100.0, 9.0) == pytest.approx(0.25)


def test_gpu_completion_ignores_the_learned_rate() -> None:
    """Throughput learned at whatever batch a GPU ran is not its speed: ranking by it
    fed the GPU that already held the biggest batch."""
    assert gpu_completion_s(gpu(rate=9000.0), 100.0, 9.0) == gpu_completion_s(gpu(), 100.0, 9.0)


def test_gpu_completion_scales_the_rate_by_the_operators_weight() -> None:
    assert gpu_completion_s(gpu(weight=2.0), 100.0, 9.0) == pytest.approx(0.25)


def test_gpu_completion_treats_a_warming_gpu_as_slower() -> None:
    assert gpu_completion_s(gpu(share=0.1), 100.0, 9.0) == pytest.approx(5.0)


def test_gpu_completion_floors_a_zero_share_instead_of_dividing_by_zero() -> None:
    assert gpu_completion_s(gpu(share=0.0), 2.0, 0.0) == pytest.approx(1.0)


def _gpu(rate: float = 2000.0, slots: int = 16) -> GpuChild:
    return GpuChild(
        name="g", endpoint=Endpoint("127.0.0.1", 1), models=frozenset(), rate=rate, slots=slots
    )


def test_an_attempt_alone_is_expected_at_its_share_of_a_full_batch() -> None:
    # 400 tokens on an idle GPU doing 2000 work/s over 16 slots: 125 tokens/s for it.
    assert attempt_expected_s(_gpu(), 400, work_ahead=0) == pytest.approx(400 * 16 / 2000)


def test_an_attempt_behind_more_than_a_batch_waits_for_all_of_it() -> None:
    assert attempt_expected_s(_gpu(), 100, work_ahead=3900) == pytest.approx(4000 / 2000)


def test_weight_and_slow_start_never_shorten_the_expected_attempt() -> None:
    gpu = _gpu()
    plain = attempt_expected_s(gpu, 400, 0)
    gpu.weight, gpu.share = 4.0, 0.1
    assert attempt_expected_s(gpu, 400, 0) == plain


def test_drain_counts_the_usable_gpus_slots_over_their_latency() -> None:
    def gpu(name: str, slots: int, latency: float) -> GpuChild:
        g = GpuChild(name=name, endpoint=Endpoint("127.0.0.1", 1), models=frozenset({"m"}))
        g.slots, g.latency_ewma_s = slots, latency
        return g

    fast, slow, new = gpu("a", 16, 0.5), gpu("b", 8, 2.0), gpu("c", 4, 0.0)
    down, ejected, drained = gpu("d", 99, 1.0), gpu("e", 99, 1.0), gpu("f", 99, 1.0)
    down.healthy, ejected.ejected, drained.drained = False, True, True
    # 16 / 0.5 + 8 / 2 + 4 / 1 (no latency learned yet: 1 s); the others are not usable.
    assert drain_rps([fast, slow, new, down, ejected, drained]) == 32 + 4 + 4
    assert drain_rps([down]) == 0


def test_a_long_request_weighs_a_slow_gpu_by_its_slowness_and_a_fast_one_less() -> None:
    slow, a100, fast = _gpu(), _gpu(), _gpu()
    slow.speed, fast.speed = 0.5, 2.0
    # Up to the typical work, nothing changes; nor with the bias off.
    assert long_request_weight(slow, 100.0, 100.0, 0.5) == 1.0
    assert long_request_weight(slow, 400.0, 100.0, 0.0) == 1.0
    assert long_request_weight(slow, 400.0, 0.0, 0.5) == 1.0  # nothing typical yet
    # Four times typical: extra = sqrt(4) - 1 = 1.
    assert long_request_weight(slow, 400.0, 100.0, 0.5) == pytest.approx(2.0)
    assert long_request_weight(a100, 400.0, 100.0, 0.5) == 1.0
    assert long_request_weight(fast, 400.0, 100.0, 0.5) == pytest.approx(0.5)
    # Capped: a request 10 000 times typical pays at most slowness ** MAX_LENGTH_EXTRA.
    assert long_request_weight(slow, 1e6, 100.0, 0.5) == pytest.approx(2.0**MAX_LENGTH_EXTRA)
