"""PrefixIndex against a plain model of its rules, on random traffic."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from local_lb.state import PrefixIndex


class PlainIndex:
    """The rules written as plainly as possible: an LRU of blocks, each with its
    newest holders first (at most ``limit``); ``matches`` from the deepest block up."""

    def __init__(self, capacity: int, limit: int) -> None:
        self.capacity, self.limit = capacity, limit
        self.blocks: OrderedDict[int, list[str]] = OrderedDict()

    def record(self, hashes: list[int], gpu: str) -> None:
        for h in hashes:
            holders = self.blocks.pop(h, [])
            holders = [gpu] + [g for g in holders if g != gpu]
            self.blocks[h] = holders[: self.limit]
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def matches(self, hashes: list[int], limit: int) -> dict[str, int]:
        found: dict[str, int] = {}
        for depth in range(len(hashes), 0, -1):
            for name in self.blocks.get(hashes[depth - 1], []):
                if name not in found and len(found) < limit:
                    found[name] = depth
        return found

    def per_gpu(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for holders in self.blocks.values():
            for g in holders:
                out[g] = out.get(g, 0) + 1
        return out

    def forget(self, gpu: str) -> None:
        for h, holders in self.blocks.items():
            self.blocks[h] = [g for g in holders if g != gpu]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_records_matches_and_forgets_as_the_plain_rules_say(seed: int) -> None:
    rng = random.Random(seed)
    index, plain = PrefixIndex(capacity_blocks=300, holders_per_block=3), PlainIndex(300, 3)
    prompts = [[rng.getrandbits(60) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    gpus = [f"g{i}" for i in range(12)]
    for step in range(3000):
        base = rng.choice(prompts)
        hashes = base[: rng.randint(1, len(base))] + [rng.getrandbits(60) for _ in range(3)]
        # Several questions about one prompt (a tuple: the last walk is kept for the next
        # one), in any order of limits, some past what it keeps, and once as a list.
        prompt = tuple(hashes)
        for limit in rng.sample([1, 2, 4, 8, 12], 3):
            assert index.matches(prompt, limit) == plain.matches(hashes, limit)
        found = index.matches(prompt, 8)
        found["someone"] = 1  # the caller's own copy: the kept walk is untouched
        assert index.matches(prompt, 8) == plain.matches(hashes, 8)
        assert index.matches(hashes, 4) == plain.matches(hashes, 4)
        gpu = rng.choice(gpus)
        index.record(hashes, gpu)
        plain.record(hashes, gpu)
        # The same prompt asked about again once the index changed: walked afresh.
        assert index.matches(prompt, 8) == plain.matches(hashes, 8)
        if step % 500 == 499:
            gone = rng.choice(gpus)
            index.forget(gone)
            plain.forget(gone)
            plain_counts = {g: n for g, n in plain.per_gpu().items() if g != gone}
            assert {g: n for g, n in index.blocks_per_gpu.items() if n} == plain_counts
    assert len(index) == len(plain.blocks) == 300
