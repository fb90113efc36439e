"""Where the oracle looks for a request's prefix: a small index of where prompts went.

The oracle knows every GPU's real prefix cache, but asking every GPU for every
request would cost O(fleet). This index says which GPUs are worth asking: for
each dispatched prompt it records the GPU under the prompt's blocks at depths
1, 2, 4, 8, … and under its last block (chained hashes: a GPU recorded at depth
d was sent the whole first d blocks), keeping the newest ``holders_per_block``
GPUs per block. A lookup walks those depths from the deepest down and gathers
up to ``max_holders`` GPUs. It is only a hint: the GPU's own cache then says
exactly how much it holds, so an entry whose blocks were evicted costs a
look, never a wrong decision. O(log blocks) per record and per lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def probe_depths(n: int) -> list[int]:
    """Prefix depths (in blocks) recorded and looked up: 1, 2, 4, … below ``n``, then n."""
    depths, d = [], 1
    while d < n:
        depths.append(d)
        d *= 2
    if n:
        depths.append(n)
    return depths


class HolderIndex:
    """Block hash -> the GPUs (by index) most recently sent a prompt through it."""

    def __init__(
        self, holders_per_block: int = 4, max_holders: int = 8, limit: int = 1_000_000
    ) -> None:
        self.holders_per_block = holders_per_block
        self.max_holders = max_holders
        self.limit = limit
        # Ordered by recency. An OrderedDict, not a dict: once the index is full every
        # record evicts the oldest, and a dict's first entry is found by walking past
        # every slot deleted at its front since its last resize (a 1024-GPU oracle run
        # slowed fourfold once the index filled, 300 000 requests in).
        self._holders: OrderedDict[int, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def remember(self, blocks: Sequence[int], gpu: int) -> None:
        """``gpu`` was sent a prompt with these leading blocks."""
        holders = self._holders
        for depth in probe_depths(len(blocks)):
            h = blocks[depth - 1]
            known = holders.get(h)
            if known is None:
                holders[h] = [gpu]
                continue
            if gpu in known:
                known.remove(gpu)
            known.insert(0, gpu)
            del known[self.holders_per_block :]
            holders.move_to_end(h)
        while len(holders) > self.limit:
            holders.popitem(last=False)

    def holders(self, blocks: Sequence[int]) -> list[int]:
        """GPUs recorded under the deepest recorded prefixes of ``blocks``, deepest first."""
        found: dict[int, None] = {}
        for depth in reversed(probe_depths(len(blocks))):
            for gpu in self._holders.get(blocks[depth - 1], ()):
                found[gpu] = None
            if len(found) >= self.max_holders:
                break
        return list(found)[: self.max_holders]
