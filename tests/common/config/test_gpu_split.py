"""split_slots: a GPU's max_concurrency shared between a local tier's workers, never more."""

from __future__ import annotations

import pytest

from common.config.gpu import GpuConfig, split_slots
from common.config.node import ConfigError, Endpoint

KEY = "regions[0].zones[0].gpus[1].max_concurrency"


def gpu(max_concurrency: int) -> GpuConfig:
    at = Endpoint("127.0.0.1", 1)
    return GpuConfig("g", at, at, "A100", ("m",), max_concurrency=max_concurrency)


@pytest.mark.parametrize(
    ("slots", "workers", "shares"),
    [
        (16, 1, [16]),
        (16, 2, [8, 8]),
        (5, 2, [3, 2]),  # the remainder to the first worker
        (16, 3, [6, 5, 5]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_the_shares_add_up_to_the_gpus_slots(slots: int, workers: int, shares: list[int]) -> None:
    held = [split_slots(gpu(slots), workers, i, KEY) for i in range(workers)]
    assert [g.slots for g in held] == shares
    assert sum(g.slots for g in held) == slots
    assert all(g.max_concurrency == slots for g in held)  # the GPU's own, kept


def test_a_gpu_holds_all_its_slots_unless_split() -> None:
    assert gpu(16).held_slots is None and gpu(16).slots == 16


def test_fewer_slots_than_workers_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        split_slots(gpu(1), 2, 0, KEY)
    assert str(err.value) == (
        f"{KEY}: 1 slots cannot be split between 2 workers (--workers); "
        "each worker must hold at least one"
    )


def test_an_index_outside_the_workers_is_a_bug() -> None:
    with pytest.raises(ValueError, match=r"worker index 2 is not in 0\.\.1"):
        split_slots(gpu(4), 2, 2, KEY)
