"""PrefixCache against a plain LRU of blocks."""

from __future__ import annotations

import random
from collections import OrderedDict

from sim.prefix_cache import PrefixCache


def test_prefix_cache_is_an_lru_of_blocks_touched_by_hits_and_inserts() -> None:
    """Against the rule written plainly: a hit or an insert makes a block the most
    recent; past capacity the least recent go."""
    rng = random.Random(7)
    cache, plain = PrefixCache(50), OrderedDict[int, None]()
    prompts = [[rng.getrandbits(60) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    for _ in range(400):
        base = rng.choice(prompts)
        hashes = [*base[: rng.randint(1, len(base))], rng.getrandbits(60)]
        hits = 0
        for h in hashes:
            if h not in plain:
                break
            plain.move_to_end(h)
            hits += 1
        assert cache.peek(hashes) == hits
        for h in hashes:
            plain[h] = None
            plain.move_to_end(h)
        while len(plain) > 50:
            plain.popitem(last=False)
        if rng.random() < 0.5:
            assert cache.cached_blocks(tuple(hashes)) == hits
            cache.insert(tuple(hashes))
        else:  # both at once, as a GPU admitting one prompt does
            assert cache.looked_up_and_inserted(tuple(hashes)) == hits
        assert list(cache._blocks) == list(plain)
