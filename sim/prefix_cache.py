"""A GPU's prefix cache: the prompt blocks whose KV is still resident, least recent out.

The emulated engine (``sim.engine``) and the fleet simulator's GPU model
(``sim.gpu_model``) keep one per GPU and touch a whole prompt's blocks on every
admission, so it is kept cheap: an OrderedDict in recency order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """LRU set of prompt-block hashes whose KV is still resident.

    An OrderedDict in recency order (least recent first): a hit moves to the end,
    the least recent fall out from the front in O(1). A plain dict (delete and
    re-insert) cost less per touch, but evicting from its front walks past every
    entry deleted there since its last resize: on a full cache of 20 000 blocks
    (an H100's) that made an admission 1.24x slower (``bench.prefix_cache``), and
    caches are full for most of a long run."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Length of the longest cached prefix, in blocks (touches the hits)."""
        blocks = self._blocks
        to_end = blocks.move_to_end
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            to_end(h)
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
        to_end = blocks.move_to_end
        for h in hashes:
            if h in blocks:
                to_end(h)
            else:
                blocks[h] = None
        excess = len(blocks) - self.capacity_blocks
        if excess > 0:
            pop = blocks.popitem
            for _ in range(excess):
                pop(last=False)
