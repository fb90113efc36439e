"""``random.Random.sample`` for the request path: the same draws, without its overhead.

Every local pick samples a few GPUs from a zone's free pool. CPython's ``sample``
is written in Python (a ``Sequence`` check through the ABC machinery, a Python
call per draw); this is its algorithm for a sequence, drawing the same numbers from the
same generator in the same order, so results stay the same to the digit. It is
also compiled with the simulator (``sim.native``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def sample(population: Sequence[T], k: int, rng: random.Random) -> list[T]:
    """``rng.sample(population, k)``: ``k`` distinct members in selection order."""
    n = len(population)
    if type(rng) is not random.Random or not 0 <= k <= n:
        return rng.sample(population, k)  # a subclass draws differently; bad k: its error
    getrandbits = rng.getrandbits
    result: list[T] = []
    # As CPython: pick from a shrinking copy when that list is smaller than the set
    # of chosen indexes would be, else redraw an index already chosen.
    setsize = 21
    if k > 5:
        setsize += 4 ** math.ceil(math.log(k * 3, 4))
    if n <= setsize:
        pool = list(population)
        for i in range(k):
            left = n - i
            bits = left.bit_length()
            j = getrandbits(bits)
            while j >= left:
                j = getrandbits(bits)
            result.append(pool[j])
            pool[j] = pool[left - 1]
        return result
    bits = n.bit_length()
    chosen: set[int] = set()
    for _ in range(k):
        j = getrandbits(bits)
        while j >= n or j in chosen:
            j = getrandbits(bits)
        chosen.add(j)
        result.append(population[j])
    return result
