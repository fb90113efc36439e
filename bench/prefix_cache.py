"""Admitting prompts into a full GPU prefix cache: ``sim.prefix_cache`` against a plain dict.

``python -m bench.prefix_cache`` admits 60 000 prompts (8 shared system prompts
of 20 blocks, then 50 blocks of their own) into a full 20 000-block cache (an
H100's) with ``PrefixCache.looked_up_and_inserted``, and the same prompts into
the plain-dict LRU it replaced (delete and re-insert to touch, evict from the
front), rounds interleaved, and prints the median CPU µs per admission of each.
The plain dict's eviction walks past every entry deleted at its front since its
last resize. Writes ``bench/results/prefix_cache.{json,md}``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path

from bench.report import machine, write_json_and_markdown
from sim.prefix_cache import PrefixCache

CAPACITY = 20_000
RESULTS = Path(__file__).parent / "results"


class PlainDictCache:
    """The LRU ``PrefixCache`` was before: a plain dict in recency order."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[int, None] = {}

    def looked_up_and_inserted(self, hashes: Sequence[int]) -> int:
        blocks, n = self._blocks, 0
        for h in hashes:
            if h not in blocks:
                break
            del blocks[h]
            blocks[h] = None
            n += 1
        for h in hashes[n:]:
            blocks.pop(h, None)
            blocks[h] = None
        excess = len(blocks) - self.capacity_blocks
        if excess > 0:
            for h in list(islice(blocks, excess)):
                del blocks[h]
        return n


def prompts(count: int, seed: int = 1) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    systems = [[rng.getrandbits(62) for _ in range(20)] for _ in range(8)]
    return [tuple(systems[i % 8] + [rng.getrandbits(62) for _ in range(50)]) for i in range(count)]


def us_per_admission(make: Callable[[int], object], batch: list[tuple[int, ...]]) -> float:
    cache = make(CAPACITY)
    admit = cache.looked_up_and_inserted  # type: ignore[attr-defined]
    for p in batch[: len(batch) // 2]:  # fill it first: the figure is a full cache's
        admit(p)
    started = time.process_time()
    for p in batch[len(batch) // 2 :]:
        admit(p)
    return 1e6 * (time.process_time() - started) / (len(batch) - len(batch) // 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=60_000)
    args = parser.parse_args()
    batch = prompts(args.prompts)
    runs: dict[str, list[float]] = {"PrefixCache (OrderedDict)": [], "plain dict": []}
    for _ in range(args.rounds):
        runs["PrefixCache (OrderedDict)"].append(us_per_admission(PrefixCache, batch))
        runs["plain dict"].append(us_per_admission(PlainDictCache, batch))
    medians = {name: statistics.median(v) for name, v in runs.items()}
    lines = ["| cache | µs per admission (median) | rounds |", "|:---|---:|---:|"]
    lines += [f"| {name} | {medians[name]:.1f} | {len(runs[name])} |" for name in runs]
    ratio = medians["plain dict"] / medians["PrefixCache (OrderedDict)"]
    text = "\n".join(lines) + f"\n\nplain dict / PrefixCache: {ratio:.2f}x\n"
    print(text)
    write_json_and_markdown(
        RESULTS, "prefix_cache", {"machine": machine(), "runs": runs, "ratio": ratio}, text
    )


if __name__ == "__main__":
    main()
