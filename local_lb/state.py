"""The local tier's view of its GPUs: per-GPU state, free-slot pools, prefix index.

Everything a picker reads lives here, kept up to date incrementally so a
pick never scans the fleet: ``FreePool`` holds, per model, the GPUs that are
routable and have a free slot (O(1) add, remove and random sample), and
``PrefixIndex`` maps recently routed prompt blocks to the GPUs that got them.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby, islice
from operator import itemgetter

from common.basics.sampling import sample
from common.config.access import GpuTls
from common.request.children import Child
from local_lb.load_book import LoadBook

_HOLDERS = itemgetter(1)  # of a (depth, holders) pair: a block somebody holds
# Most GPUs a question to PrefixIndex.matches is answered from its last walk for: the
# balancer's lease asks for this many (after its picker asked for as many or fewer).
MATCH_MEMO_LIMIT = 8


@dataclass(eq=False)
class GpuChild(Child):
    """One GPU as the local tier sees it."""

    hardware: str = "A100"
    # The slots this process may fill (its share of them under --workers).
    slots: int = 16
    # The GPU's whole max_concurrency when ``slots`` is this process's share of it
    # (``meridian local --workers N``); 0: ``slots`` is all of it.
    gpu_slots: int = 0
    # Versions served per model (empty: any version).
    versions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # Service rate in work units per second (decode-token equivalents), learned online.
    rate: float = 1.0
    latency_ewma_s: float = 0.0
    ejected: bool = False
    share: float = 1.0  # slow-start factor, refreshed by the balancer
    # Operator's weight (Admin SetWeight): scales the hardware speed when picking.
    weight: float = 1.0
    # Its entry's ``tls`` when its channel was opened (a reload does not change it).
    tls: GpuTls | None = None
    # How the tier talks to it: "v2" (its stub a gRPC one) or "openai" (an OpenAIStub).
    protocol: str = "v2"

    # healthy_since of the recovery slow start was last started for.
    last_seen_healthy: float = float("-inf")

    @property
    def free_slots(self) -> int:
        return self.slots - self.outstanding_requests

    @property
    def whole_slots(self) -> int:
        """The GPU's whole concurrency, whatever share of it this process holds: what the
        zone's summary counts, so the summaries of a zone's workers combine to the GPU's
        (``common.capacity.summary.combine_replicas`` takes slots once, busy ones summed)."""
        return self.gpu_slots or self.slots

    @property
    def usable(self) -> bool:
        """Routable at all: healthy by direct evidence, not ejected, not drained."""
        return self.healthy and not self.ejected and not self.drained

    def serves(self, model: str, version: str = "") -> bool:
        if model not in self.models:
            return False
        known = self.versions.get(model)
        return not version or not known or version in known


class FreePool(Sequence[GpuChild]):
    """An indexable set of GPUs (swap-remove): O(1) membership changes and sampling."""

    def __init__(self) -> None:
        self._items: list[GpuChild] = []
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> GpuChild:  # type: ignore[override]
        return self._items[i]

    def __iter__(self) -> Iterator[GpuChild]:
        return iter(self._items)

    def __contains__(self, gpu: object) -> bool:
        return isinstance(gpu, GpuChild) and gpu.name in self._index

    def add(self, gpu: GpuChild) -> None:
        if gpu.name not in self._index:
            self._index[gpu.name] = len(self._items)
            self._items.append(gpu)

    def discard(self, gpu: GpuChild) -> None:
        i = self._index.pop(gpu.name, None)
        if i is None:
            return
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._index[last.name] = i

    @classmethod
    def of(cls, gpus: Sequence[Child]) -> FreePool:
        pool = cls()
        for gpu in gpus:
            if isinstance(gpu, GpuChild):
                pool.add(gpu)
        return pool

    def sample(self, k: int, rng: random.Random) -> list[GpuChild]:
        if len(self._items) <= k:
            return list(self._items)
        # The same draws as sampling indexes (random.sample only indexes its population).
        return sample(self._items, k, rng)


class PrefixIndex:
    """Which GPUs were recently sent which prompt blocks (bounded, approximate).

    An LRU over block hashes, each remembering up to ``holders_per_block``
    GPUs, newest first. It approximates the GPUs' prefix caches without
    asking them: a block routed to a GPU is likely still cached there while it
    is recent. Bounded by ``capacity_blocks``; the oldest blocks fall out.
    Holders are tuples of names, replaced rather than edited: a tuple of strings
    is left out of the cyclic GC once seen, where a list per block (up to
    ``capacity_blocks`` of them) would be scanned by every full collection.
    """

    def __init__(self, capacity_blocks: int = 200_000, holders_per_block: int = 4) -> None:
        self.capacity_blocks = capacity_blocks
        self.holders_per_block = holders_per_block
        self._blocks: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self.blocks_per_gpu: dict[str, int] = {}
        # The last walk of ``matches`` (hashes, index version, GPUs found up to
        # MATCH_MEMO_LIMIT): a pick and then its lease ask about the same prompt, and
        # each walk is ~64 dict lookups into a large table (memory-bound).
        self._version = 0
        self._memo: tuple[tuple[int, ...], int, dict[str, int]] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, hashes: Sequence[int], gpu: str) -> None:
        """``gpu`` was sent a prompt with these blocks: it now likely caches them.

        Runs for every request over up to ``MAX_CARRIED_BLOCKS`` blocks, so the
        common cases — a block not seen before, a run of blocks recorded together
        before (the same holders) — take one dict lookup, and a run's new holders
        are worked out once and shared."""
        self._version += 1
        blocks, per_gpu = self._blocks, self.blocks_per_gpu
        get, to_end = blocks.get, blocks.move_to_end
        only: tuple[str, ...] = (gpu,)  # one tuple for every block new here (immutable)
        added = 0
        seen: tuple[str, ...] | None = None  # the holders last worked out, and after:
        became, gained, dropped = only, 0, None
        for h in hashes:
            holders = get(h)
            if holders is None:
                blocks[h] = only
                added += 1
                continue
            to_end(h)
            if holders != seen:
                seen = holders
                became, gained, dropped = self._holders_after(holders, gpu)
            if became is not holders:
                blocks[h] = became
            added += gained
            if dropped is not None:
                per_gpu[dropped] -= 1
        if added:
            per_gpu[gpu] = per_gpu.get(gpu, 0) + added
        while len(blocks) > self.capacity_blocks:
            _, gone = blocks.popitem(last=False)
            for name in gone:
                per_gpu[name] -= 1

    def _holders_after(
        self, holders: tuple[str, ...], gpu: str
    ) -> tuple[tuple[str, ...], int, str | None]:
        """A block's holders once ``gpu`` was sent it (newest first, at most
        ``holders_per_block``), whether ``gpu`` is a new holder, and who fell off."""
        if holders and holders[0] == gpu:
            return holders, 0, None
        if gpu in holders:
            return (gpu, *(name for name in holders if name != gpu)), 0, None
        if len(holders) >= self.holders_per_block:
            return (gpu, *holders[:-1]), 1, holders[-1]
        return (gpu, *holders), 1, None

    def matches(self, hashes: Sequence[int], limit: int = 4) -> dict[str, int]:
        """GPUs holding a prefix of ``hashes`` and how many leading blocks each holds.

        Walks from the deepest block up; chained hashes mean a GPU that holds
        block i was sent blocks 0..i too. At most ``limit`` GPUs: the first
        ``limit`` a walk for more would find, so a walk for MATCH_MEMO_LIMIT is
        kept for the next question about the same prompt (a tuple) until the
        index changes.
        """
        if limit > MATCH_MEMO_LIMIT or type(hashes) is not tuple:
            return self._walk(hashes, limit)
        memo = self._memo
        if memo is None or memo[0] is not hashes or memo[1] != self._version:
            memo = self._memo = (hashes, self._version, self._walk(hashes, MATCH_MEMO_LIMIT))
        return dict(islice(memo[2].items(), limit))

    def _walk(self, hashes: Sequence[int], limit: int) -> dict[str, int]:
        found: dict[str, int] = {}
        # In C (a walk is the deepest block up, most of a prompt's blocks its own, and
        # blocks recorded together sharing their holders): the lookups, the skipping of
        # blocks nobody holds, and of a run of blocks with the holders of the deepest
        # one (they name no GPU that one did not). Python sees one block per run.
        lookups = map(self._blocks.get, reversed(hashes))
        held = filter(_HOLDERS, zip(range(len(hashes), 0, -1), lookups, strict=True))
        for holders, run in groupby(held, _HOLDERS):
            depth = next(run)[0]
            for name in holders:
                if name not in found:
                    found[name] = depth
                    if len(found) >= limit:
                        return found
        return found

    def forget(self, gpu: str) -> None:
        """A GPU left (or restarted with an empty cache): drop it everywhere, lazily cheap."""
        self._version += 1
        blocks = self._blocks
        for h in list(blocks):
            holders = blocks[h]
            if gpu in holders:
                blocks[h] = tuple(name for name in holders if name != gpu)
        self.blocks_per_gpu.pop(gpu, None)


# A few hundred requests make the typical work: steady, yet it follows a workload's shift.
TYPICAL_WORK_ALPHA = 0.01


@dataclass
class LocalView:
    """The snapshot local pickers read: GPUs, free pools per model, prefix index,
    and the newest load report of each GPU."""

    gpus: tuple[GpuChild, ...]
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    # Each GPU's own reports (metrics scrapes, response trailers).
    load: LoadBook = field(default_factory=LoadBook)
    # A GPU's own load report older than this is unknown.
    report_max_age_s: float = 2.0
    inflight_total: int = 0
    # The work of a typical request here: an EWMA over the requests leased (0: none
    # yet). What the default picker measures a request's length against.
    typical_work: float = 0.0

    def took(self, work: float) -> None:
        """A request of ``work`` (uncached) was leased: it moves ``typical_work``."""
        if self.typical_work:
            self.typical_work += TYPICAL_WORK_ALPHA * (work - self.typical_work)
        else:
            self.typical_work = work

    def __post_init__(self) -> None:
        self.free: dict[str, FreePool] = {}
        self._index()

    def _index(self) -> None:
        """Derive the per-name and per-model indexes and the free pools from ``gpus``."""
        self.by_name = {g.name: g for g in self.gpus}
        self.by_model: dict[str, tuple[GpuChild, ...]] = {}
        for gpu in self.gpus:
            for model in gpu.models:
                self.by_model[model] = (*self.by_model.get(model, ()), gpu)
        # Pools are kept (not replaced) so a picker holding one sees later changes.
        for model in self.by_model:
            self.free.setdefault(model, FreePool())
        for model, pool in self.free.items():
            for gpu in list(pool):
                if gpu.name not in self.by_name or model not in gpu.models:
                    pool.discard(gpu)
        self._serving: dict[tuple[str, str], tuple[GpuChild, ...]] = {}
        for gpu in self.gpus:
            self.refresh(gpu)

    def set_gpus(self, gpus: Sequence[GpuChild]) -> None:
        """A reloaded topology added or removed GPUs (or changed their models)."""
        self.gpus = tuple(gpus)
        self._index()

    def refresh(self, gpu: GpuChild) -> None:
        """Put ``gpu`` in or out of its models' free pools after any state change."""
        available = gpu.usable and gpu.free_slots > 0 and gpu.name in self.by_name
        for model in gpu.models:
            pool = self.free.get(model)
            if pool is None:
                continue
            if available:
                pool.add(gpu)
            else:
                pool.discard(gpu)

    def reported_requests(self, gpu: GpuChild, now: float) -> float | None:
        """Running + waiting as the GPU last reported, or None when its report went stale.

        A GPU that never reported its load (a stock server with no load trailer and no
        metric this tier reads, such as MLServer) reads as 0, nothing beyond this tier's
        own requests in flight (``local_lb.cost`` takes the larger): it is routed by
        those, since it has no report to go stale, and the stale-report penalty would
        starve it beside GPUs that do report."""
        sample = self.load.get(gpu.name, now, self.report_max_age_s)
        if sample is not None:
            return sample.running + sample.waiting
        return 0.0 if gpu.name not in self.load.newest else None

    def serving(self, model: str, version: str = "") -> tuple[GpuChild, ...]:
        """GPUs serving ``model`` (at ``version``); cached, the GPU set is fixed."""
        key = (model, version)
        gpus = self._serving.get(key)
        if gpus is None:
            gpus = tuple(g for g in self.by_model.get(model, ()) if g.serves(model, version))
            if len(self._serving) < 10_000:  # versions come from requests: bound the cache
                self._serving[key] = gpus
        return gpus
