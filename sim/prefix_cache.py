"""A GPU's prefix cache: the prompt blocks whose KV is still resident, least recent out.

The emulated engine (``sim.engine``) and the fleet simulator's GPU model
(``sim.gpu_model``) keep one per GPU and touch a whole prompt's blocks on every
admission, so it is kept cheap: a plain dict in recency order.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice


class PrefixCache:
    """LRU set of prompt-block hashes whose KV is still resident.

    A plain dict in recency order (least recent first): a block is made the most
    recent by deleting and re-inserting it, which costs less than an OrderedDict's
    move (every admission touches a whole prompt's blocks on a simulated fleet)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Length of the longest cached prefix, in blocks (touches the hits)."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            del blocks[h]
            blocks[h] = None
            n += 1
        return n

    def peek(self, hashes: Sequence[int]) -> int:
        """``cached_blocks`` without touching the hits: a look that changes nothing."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def looked_up_and_inserted(self, hashes: Sequence[int]) -> int:
        """``cached_blocks(hashes)`` and then ``insert(hashes)``, at once (a GPU admitting
        one prompt): the hits have just been made the most recent, in order, where
        inserting them again would leave them, so only the rest is inserted."""
        hits = self.cached_blocks(hashes)
        self._insert(hashes[hits:] if hits else hashes)
        return hits

    def insert(self, hashes: Sequence[int]) -> None:
        """The blocks become the most recent, in order; the least recent fall out."""
        self._insert(hashes)

    def _insert(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        pop = blocks.pop
        for h in hashes:
            pop(h, None)
            blocks[h] = None
        excess = len(blocks) - self.capacity_blocks
        if excess > 0:
            for h in list(islice(blocks, excess)):
                del blocks[h]
