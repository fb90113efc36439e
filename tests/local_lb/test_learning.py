"""RateLearner: EWMAs seeded by the first sample, expected service time, zone capacity."""

from __future__ import annotations

import math

import pytest

from local_lb.cost import RATE_EWMA_ALPHA
from local_lb.learning import RateLearner
from tests.local_lb.parts import gpus


def test_the_first_arrival_seeds_the_work_ewma_and_later_ones_move_it() -> None:
    rates = RateLearner()
    rates.arrived(100.0)
    assert rates.work_ewma == 100.0
    rates.arrived(200.0)
    assert rates.work_ewma == pytest.approx(100.0 + RATE_EWMA_ALPHA * 100.0)


def test_expected_service_is_unknown_until_a_request_finished() -> None:
    rates = RateLearner()
    rates.arrived(100.0)
    assert rates.expected_service_s(100.0) == 0.0
    assert math.isinf(rates.capacity_work_per_s(16))


def test_a_finished_request_teaches_rate_latency_and_service_time() -> None:
    rates = RateLearner()
    [gpu] = gpus(1)
    rates.arrived(100.0)
    rates.finished_ok(gpu, work=100.0, elapsed_s=0.5, concurrent=4)
    # 200 work/s seen by the request, shared with 3 others: 800 work/s for the GPU.
    assert gpu.rate == pytest.approx(2000.0 + RATE_EWMA_ALPHA * (800.0 - 2000.0))
    assert gpu.latency_ewma_s == 0.5 and rates.service_s == 0.5
    assert rates.expected_service_s(200.0) == pytest.approx(1.0)  # twice the typical size
    assert rates.capacity_work_per_s(4) == pytest.approx(4 * 100.0 / 0.5)


def test_a_zero_elapsed_time_teaches_no_rate() -> None:
    rates = RateLearner()
    [gpu] = gpus(1)
    rates.finished_ok(gpu, work=100.0, elapsed_s=0.0, concurrent=1)
    assert gpu.rate == 2000.0
