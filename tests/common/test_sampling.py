"""``common.basics.sampling.sample`` draws what ``random.Random.sample`` draws."""

from __future__ import annotations

import random

import pytest

from common.basics.sampling import sample


@pytest.mark.parametrize("n", [1, 2, 3, 7, 21, 22, 40, 90, 200, 1000])
def test_the_same_members_in_the_same_order_and_the_generator_left_the_same(n: int) -> None:
    population = [f"gpu-{i}" for i in range(n)]
    for seed in range(30):
        for k in sorted({k for k in (0, 1, 2, 4, 6, n // 2, n) if k <= n}):
            ours, theirs = random.Random(seed), random.Random(seed)
            assert sample(population, k, ours) == theirs.sample(population, k), (seed, k)
            assert ours.getstate() == theirs.getstate()


def test_a_subclass_and_a_bad_k_are_left_to_random() -> None:
    class Biased(random.Random):
        def random(self) -> float:
            return 0.0

    pool = list(range(10))
    assert sample(pool, 3, Biased(1)) == Biased(1).sample(pool, 3)
    with pytest.raises(ValueError, match="larger than population"):
        sample(pool, 11, random.Random(1))
